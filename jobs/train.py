"""Entry point for `ray job submit`: the same flags as `raylm train`.

    ray job submit --address http://127.0.0.1:8265 --working-dir . -- \
        python jobs/train.py --max_steps 100 --output_dir s3://my-bucket/runs/run1

Inside a Ray job, RAY_ADDRESS is set, so the driver joins the job's cluster. With
--working-dir ., the package travels with the job and the rank actors import it from there.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from raylm.cli.main import run  # noqa: E402

if __name__ == "__main__":
    sys.exit(run(["train", *sys.argv[1:]]))
