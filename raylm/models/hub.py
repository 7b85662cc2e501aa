"""Hugging Face Hub names for --model_name_or_path, --config_name and --tokenizer_name.

A name that is not a local path is a Hub repository id (``gpt2``, ``org/model``): its
files are fetched with huggingface_hub's ``snapshot_download`` into the Hugging Face cache
(``--cache_dir``, else HF's own: ``$HF_HUB_CACHE`` / ``$HF_HOME``), at ``--model_revision``
(a branch, tag or commit), with ``--token`` for private or gated repositories. Offline
(``HF_HUB_OFFLINE=1``) the cache alone answers. Everything after this sees a local
directory, as for a model saved with ``save_pretrained``.

The driver resolves the name once and pins the commit it found, so every rank builds the
same revision: a rank on a node where that snapshot is not on disk (a cache that is not
shared storage) fetches that commit itself (``ensure_local``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from raylm.errors import ConfigError, first_line

# What a model needs to load: configs and tokenizer files, safetensors weights (and the
# custom code of a --trust_remote_code model). PyTorch .bin weights only when a
# repository has no safetensors.
MODEL_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.py"]


@dataclass(frozen=True)
class HubRef:
    """Where a local snapshot came from: enough for another node to fetch the same one."""

    repo_id: str
    commit: str
    cache_dir: Optional[str]
    token: Optional[str]


def is_hub_name(name: str) -> bool:
    """Not a local path: a Hub repository id (one or two parts, no leading ./ or /)."""
    return (not os.path.exists(name) and not name.startswith((".", "/", "~"))
            and 1 <= len(name.split("/")) <= 2 and all(name.split("/")))


def fetch(name: str, flag: str, revision: Optional[str], token: Optional[str],
          cache_dir: Optional[str]) -> tuple[str, HubRef]:
    """(local snapshot directory, HubRef) of the Hub repository ``name``, downloading
    what is missing (nothing, offline). One ConfigError line naming ``flag`` when the
    repository, the revision or the network is not there."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    try:
        path = snapshot_download(name, revision=revision, token=token, cache_dir=cache_dir,
                                 allow_patterns=MODEL_FILES)
        if not any(f.endswith(".safetensors") for f in os.listdir(path)) and \
                os.path.isfile(os.path.join(path, "config.json")):
            path = snapshot_download(name, revision=revision, token=token,
                                     cache_dir=cache_dir, allow_patterns=["*.bin"])
    except RevisionNotFoundError:
        raise ConfigError(f"{flag} {name}: no revision '{revision}' (--model_revision)") \
            from None
    except GatedRepoError:
        raise ConfigError(f"{flag} {name} is gated on the Hub: accept its terms there and "
                          "give --token (or log in with `hf auth login`)") from None
    except RepositoryNotFoundError:
        raise ConfigError(f"{flag} {name}: no such local directory, nor a Hub repository "
                          "this token can read (private? give --token)") from None
    except LocalEntryNotFoundError:
        where = cache_dir or "the Hugging Face cache"
        raise ConfigError(f"{flag} {name}: not a local directory, and not in {where} at "
                          f"revision {revision or 'main'}; the Hub cannot be reached "
                          "(offline: HF_HUB_OFFLINE is set, or no network). Download it "
                          "where there is a network (`hf download`), or give a local "
                          "directory") from None
    except Exception as e:  # network errors and the like: one line
        raise ConfigError(f"{flag} {name}: cannot fetch it from the Hub: "
                          f"{first_line(e)}") from None
    return path, HubRef(name, os.path.basename(os.path.normpath(path)), cache_dir, token)


def ensure_local(path: str, ref: Optional[HubRef]) -> str:
    """``path`` when it exists on this node, else the same commit fetched here."""
    if ref is None or os.path.isdir(path):
        return path
    return fetch(ref.repo_id, "--model_name_or_path", ref.commit, ref.token,
                 ref.cache_dir)[0]
