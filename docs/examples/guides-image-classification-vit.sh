set -euo pipefail
# 0. An image folder: photos/{train,val}/<class>/<n>.png, three classes of shapes
python - <<'PY'
from pathlib import Path
import numpy as np
from PIL import Image
rng = np.random.default_rng(0)
yy, xx = np.mgrid[:24, :24]
for split, count in (("train", 12), ("val", 4)):
    for kind in ("circle", "square", "bar"):
        Path(f"photos/{split}/{kind}").mkdir(parents=True, exist_ok=True)
        for i in range(count):
            img = rng.integers(0, 60, (24, 24, 3)).astype(np.uint8)
            y, x = rng.integers(6, 18, 2)
            mask = {"circle": (yy - y) ** 2 + (xx - x) ** 2 <= 25,
                    "square": (abs(yy - y) <= 4) & (abs(xx - x) <= 4),
                    "bar": (abs(yy - y) <= 1) & (abs(xx - x) <= 6)}[kind]
            img[mask] = rng.integers(120, 256, 3)
            Image.fromarray(img).save(f"photos/{split}/{kind}/{i}.png")
PY
# 1. A tiny ViT on 2 ranks
raylm train --task image-classification --model_type vit \
    --config_overrides image_size=16,patch_size=4,hidden_size=32,num_hidden_layers=2,num_attention_heads=2,intermediate_size=64 \
    --train_dir photos/train --validation_dir photos/val --num_workers 2 \
    --per_device_train_batch_size 4 --learning_rate 2e-3 --max_steps 10 --output_dir my-vit
# 2. Classify with plain transformers
python - <<'PY'
import raylm  # noqa: F401  (first: lets torchvision import beside a CPU-only torch)
from transformers import pipeline
print(pipeline("image-classification", model="my-vit")("photos/val/circle/0.png"))
PY
