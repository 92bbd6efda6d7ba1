"""Does a larger draft vocabulary raise the shipped Qwen head's held-out acceptance without training?

The added ids are the most frequent response tokens of the committed corpus (chunks 0-18) that the head's 8,192 lack;
their lm_head rows are mapped linearly from the target's lm_head rows (ridge least squares over the 8,192 rows the
head was trained with, an intercept included). Validation is train-head's (held-out chunk, float32, TTT 3, 8 steps).

    python docs/results/second-target-2026-11-27-epyc/vocab-extension/check.py [RIDGE] > log.txt   # writes results.json
"""
import json, sys, time
from pathlib import Path
import numpy as np, torch
from dataclasses import replace
from adaptree.models import load_model
from adaptree.models.eagle3 import Eagle3Head, build_vocab_map
from adaptree.head_training.chunked import open_corpora, read_corpora
from adaptree.head_training.features import OnlineFeatures, target_fingerprint
from adaptree.head_training.trainer import HeadTrainer, TrainHeadConfig
torch.set_num_threads(2)
H = "src/adaptree/heads/qwen2.5-coder-0.5b"
C = "corpora/qwen2.5-coder-0.5b-greedy"
target, tok = load_model("qwen2.5-coder-0.5b", dtype=torch.float32)
target.eval()
V = target.config.vocab_size
seqs = [s.cut(1024) for s in read_corpora(open_corpora(C), 19)]
cfg = TrainHeadConfig(out="/tmp/vocab-extension-run", corpus=C, ttt_steps=3, val_steps=8, train_dtype="float32",
                      target_dtype="float32", batch_tokens=4096, model="qwen2.5-coder-0.5b")
val = [s for s in seqs if s.split == "val"]
train = [s for s in seqs if s.split == "train"]
def response_counts(seqs):
    out = np.zeros(V, np.int64)
    for s in seqs:
        ids = np.array(s.input_ids); m = np.array(s.loss_mask, bool)
        out += np.bincount(ids[m], minlength=V)
    return torch.tensor(out, dtype=torch.float64)


counts, val_counts = response_counts(train), response_counts(val)
store = OnlineFeatures(target, val + train[:1], fingerprint=target_fingerprint(target, "q"))
tr = HeadTrainer(cfg, target, store)
base = Eagle3Head.from_pretrained(H, target, dtype=torch.float32)
E = target.lm_head.weight.detach().float()  # [V, 896]
old_ids = (torch.arange(base.config.draft_vocab_size) + base.d2t)
W = base.lm_head.weight.detach().float()
# least squares: W ~ [E_old, 1] @ A
X = torch.cat([E[old_ids], torch.ones(len(old_ids), 1)], 1)
perm = torch.randperm(len(old_ids), generator=torch.Generator().manual_seed(0))
fit, hold = perm[:7000], perm[7000:]
for lam in (1e-3, 1e-2, 1e-1, 1.0):
    A = torch.linalg.solve(X[fit].T @ X[fit] + lam * torch.eye(X.shape[1]), X[fit].T @ W[fit])
    r = W[hold] - X[hold] @ A
    print(f"lam {lam}: held-out R2 {1 - r.pow(2).sum() / (W[hold] - W[hold].mean(0)).pow(2).sum():.3f}", flush=True)
lam = float(sys.argv[1]) if len(sys.argv) > 1 else 1e-1
A = torch.linalg.solve(X.T @ X + lam * torch.eye(X.shape[1]), X.T @ W)

def extended(n):
    # keep every old id, add the most frequent new ones
    c = counts.clone()
    c[old_ids] = 1e18  # every old id stays
    d2t, t2d = build_vocab_map(c, n)
    new_ids = torch.arange(n) + d2t
    cfgn = replace(base.config, draft_vocab_size=n)
    h = Eagle3Head(cfgn, with_embeddings=False)
    sd = {k: v for k, v in base.state_dict().items() if k not in ("lm_head.weight", "d2t", "t2d") and "embed" not in k}
    res = h.load_state_dict(sd, strict=False)
    assert not res.unexpected_keys and set(res.missing_keys) <= {"lm_head.weight", "d2t", "t2d"}, res
    rows = X.new_zeros(n, W.shape[1])
    pos_old = {int(t): i for i, t in enumerate(old_ids)}
    Xn = torch.cat([E[new_ids], torch.ones(n, 1)], 1)
    mapped = Xn @ A
    for j, t in enumerate(new_ids.tolist()):
        rows[j] = W[pos_old[t]] if t in pos_old else mapped[j]
    with torch.no_grad():
        h.lm_head.weight.copy_(rows); h.d2t.copy_(d2t); h.t2d.copy_(t2d)
    h.attach_embeddings(target.model.embed_tokens.weight)
    return h.float().eval()

results = {}
def run(name, h):
    t = time.time()
    lm_rows = target.lm_head.weight[h.t2d].detach().float()
    v = tr.validate(h, lm_rows)
    results[name] = {"draft_vocab": len(h.d2t), "val_coverage": float(val_counts[h.t2d].sum() / val_counts.sum()),
                     "step0": v["step_acc"][0], "chain_tau": v.get("chain_tau"), "step_acc": v["step_acc"][:4]}
    print(name, json.dumps(results[name]), f"{time.time() - t:.0f}s", flush=True)

run("shipped-8192", base)
for n in (16384, 32768):
    run(f"mapped-{n}", extended(n))
out = Path(__file__).with_name("results.json")
out.write_text(json.dumps({"ridge": lam, "results": results}, indent=1) + "\n")
