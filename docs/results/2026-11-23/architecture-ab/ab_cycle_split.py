import sys, json, statistics, torch
torch.set_num_threads(2)
try:
    from adaptree.models import load_model, shipped_head
    from adaptree.core.engine import Engine
    from adaptree.core.controller import StaticConfig, StaticController
except ImportError:
    from adaptree.models.registry import load_model, shipped_head
    from adaptree.engine import Engine
    from adaptree.controllers import StaticConfig, StaticController
from adaptree.models.eagle3 import Eagle3Head
t, tok = load_model(None, dtype=torch.bfloat16)
head = Eagle3Head.from_pretrained(shipped_head(None), target=t, dtype=torch.bfloat16).eval()
eng = Engine(t, head, eos_token_ids=())
ids = tok.apply_chat([{"role": "user", "content": "Explain how a hash map works."}])
out = {"side": sys.argv[1]}
for name, cfg in (("ar", None), ("static-2-6", StaticConfig(10, 2, 6))):
    eng.generate(ids, StaticController(cfg) if cfg else None, max_new_tokens=8)
    r = eng.generate(ids, StaticController(cfg) if cfg else None, max_new_tokens=96)
    cyc = r.cycles
    out[name] = {k: round(1e6 * statistics.median(getattr(c, k) for c in cyc), 1) for k in ("draft_s", "verify_s", "policy_s", "other_s")}
print(json.dumps(out))
