"""One side of an A/B: tokens/s of AR and two static trees on the real model (bf16, 2 threads), JSON line out."""
import json, sys, time, statistics
import torch
torch.set_num_threads(2)
side = sys.argv[1]
try:
    from adaptree.models import load_model, shipped_head
except ImportError:
    from adaptree.models.registry import load_model, shipped_head
from adaptree.models.eagle3 import Eagle3Head
try:
    from adaptree.core.engine import Engine
    from adaptree.core.controller import StaticConfig, StaticController
except ImportError:
    from adaptree.engine import Engine
    from adaptree.controllers import StaticConfig, StaticController
target, tok = load_model(None, dtype=torch.bfloat16)
head = Eagle3Head.from_pretrained(shipped_head(None), target=target, dtype=torch.bfloat16).eval()
eng = Engine(target, head, eos_token_ids=())
prompts = ["Explain how a hash map works.", "Write a Python function that reverses a linked list.", "What causes the seasons on Earth?"]
ids = [tok.apply_chat([{"role": "user", "content": p}]) for p in prompts]
arms = {"ar": None, "static-2-6": StaticConfig(10, 2, 6), "static-8-60": StaticConfig(10, 8, 60)}
eng.generate(ids[0], None, max_new_tokens=8); eng.generate(ids[0], StaticController(StaticConfig(10, 2, 6)), max_new_tokens=8)
out = {}
for name, cfg in arms.items():
    tps = []
    for x in ids:
        r = eng.generate(x, StaticController(cfg) if cfg else None, max_new_tokens=64)
        tps.append(r.new_tokens / r.wall_time_s)
    out[name] = statistics.median(tps)
print(json.dumps({"side": side, **out}))
