"""A Hugging Face Hub cache written by the test itself, in the hub's cache layout, for
loading Hub ids offline (HF_HUB_OFFLINE=1): <cache>/<kind>s--<org>--<name>/ with
blobs/<sha256>, snapshots/<commit>/<file> -> ../../blobs/<sha256>, refs/<revision>."""

from __future__ import annotations

import hashlib
import os
import shutil


def write_repo(cache: str, repo_id: str, source_dir: str, revision: str = "main",
               kind: str = "model") -> str:
    """Put the files of ``source_dir`` into ``cache`` as revision ``revision`` of the
    Hub repository ``repo_id``; returns the commit id given to it."""
    repo = os.path.join(cache, f"{kind}s--" + repo_id.replace("/", "--"))
    files = sorted(os.path.relpath(os.path.join(d, f), source_dir)
                   for d, _, names in os.walk(source_dir) for f in names)
    digest = hashlib.sha1()
    for rel in files:
        digest.update(rel.encode() + open(os.path.join(source_dir, rel), "rb").read())
    commit = digest.hexdigest()
    for rel in files:
        data = open(os.path.join(source_dir, rel), "rb").read()
        blob = os.path.join(repo, "blobs", hashlib.sha256(data).hexdigest())
        os.makedirs(os.path.dirname(blob), exist_ok=True)
        if not os.path.exists(blob):
            shutil.copyfile(os.path.join(source_dir, rel), blob)
        link = os.path.join(repo, "snapshots", commit, rel)
        os.makedirs(os.path.dirname(link), exist_ok=True)
        if not os.path.lexists(link):
            os.symlink(os.path.relpath(blob, os.path.dirname(link)), link)
    os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
    with open(os.path.join(repo, "refs", revision), "w") as f:
        f.write(commit)
    return commit
