"""Copy a trained head into the package (``src/adaptree/heads/<name>``), stored as int8 rows or bfloat16.

    python scripts/ship_head.py training/qwen2.5-coder-0.5b-head/head --model qwen2.5-coder-0.5b \
        --out src/adaptree/heads/qwen2.5-coder-0.5b --storage int8

int8 rows (``Eagle3Head.save_pretrained(dtype=torch.int8)``) halve the bytes of bfloat16: the repository travels
whole to the GPU machine, at most 64 MiB per call, so a larger model's head is stored so. The script checks the
shipped copy against the trained one on random target features and prints the file sizes and the largest
logit difference, and keeps whatever else the folder holds (policies, static tree, chain calibration).

The source may also be a train-head checkpoint folder (``<out>/best`` or ``<out>/ckpt``: ``weights.safetensors``
and ``state.json``), for a run stopped before its end: the head is rebuilt from the run's settings in
``state.json`` (draft vocabulary, MLP width) and the checkpoint's weights.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from adaptree.models import load_model
from adaptree.models.eagle3 import Eagle3Head
from adaptree.offline import runs

STORAGE = {"int8": torch.int8, "bfloat16": torch.bfloat16}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("head", help="the trained head folder (train-head's <out>/head)")
    ap.add_argument("--model", required=True, help="its target (a registered name, folder or .gguf)")
    ap.add_argument("--out", required=True, help="the folder to write config.json and model.safetensors to")
    ap.add_argument("--storage", choices=sorted(STORAGE), default="int8")
    args = ap.parse_args()
    target, _ = load_model(args.model, dtype=torch.float32, weights="float")
    if (Path(args.head) / "weights.safetensors").is_file():  # a checkpoint of a run stopped early
        state = runs.checkpoint_state(args.head)  # best/ keeps only its step: the run's settings are in ckpt/
        run = state.get("run") or runs.checkpoint_state(Path(args.head).parent / "ckpt")["run"]
        trained = Eagle3Head.init_for_target(target, run["draft_vocab"], intermediate_size=run.get("head_intermediate"),
                                             dtype=torch.float32)
        step = runs.load_checkpoint(args.head, trained).get("step")
        print(f"{args.head}: a checkpoint at step {step}")
        trained.eval()
    else:
        trained = Eagle3Head.from_pretrained(args.head, target=target, dtype=torch.float32).eval()
    trained.save_pretrained(args.out, dtype=STORAGE[args.storage])
    shipped = Eagle3Head.from_pretrained(args.out, target=target, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    feats = torch.randn(1, 16, 3 * target.config.hidden_size, generator=gen)
    ids = torch.randint(0, target.config.vocab_size, (1, 16), generator=gen)
    with torch.no_grad():
        _, a = trained(feats, ids)
        _, b = shipped(feats, ids)
    agree = float((a.argmax(-1) == b.argmax(-1)).float().mean())
    size = lambda p: sum(f.stat().st_size for f in Path(p).glob("*.safetensors")) / 1e6  # noqa: E731
    print(f"{args.head}: {size(args.head):.1f} MB -> {args.out}: {size(args.out):.1f} MB ({args.storage}); "
          f"largest logit difference {float((a - b).abs().max()):.4f}, argmax agreement {agree:.3f}")


if __name__ == "__main__":
    main()
