"""A chain calibration fitted on a committed self-distilled corpus (greedy or sampled), not a machine setup's traces.

    python scripts/chain_from_corpus.py corpora/smollm2-135m-greedy --sequences 2000 --tokens 64 \
        --out runs/chaincal/corpus64.json

The chain rates (how often a context match's continuation is what the target says next) depend on the target's
outputs only, so a corpus (the target's answers to ShareGPT prompts, greedy or sampled at the temperature its
manifest records: the rates at that temperature) gives two orders of magnitude more samples than the 12 tuning
prompts of a machine setup. The file records the corpus, not a model digest, so
nothing checks it against the model in use. Use it with ``--hybrid-chain`` (or
``--ltd-chain`` ...) in ``adaptree simulate`` / ``bench``. Its result on the context sets is in
docs/results/context-sim-2026-11-25/README.md (no gain: not shipped).
"""

from __future__ import annotations

import argparse
import time

from tqdm import tqdm

from adaptree.head_training.chunked import ChunkedCorpus
from adaptree.methods.common.chain import ChainCalibration


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("corpus", help="a chunked corpus folder of greedy generations (train-head --corpus)")
    ap.add_argument("--sequences", type=int, default=2000, help="the first N training sequences (default 2000)")
    ap.add_argument("--tokens", type=int, default=64, help="chain tokens the rates cover (default 64)")
    ap.add_argument("--max-ngram", type=int, default=4, help="the context index's longest n-gram (default 4)")
    ap.add_argument("--out", required=True, help="the chain calibration JSON to write")
    args = ap.parse_args()
    corpus = ChunkedCorpus(args.corpus)
    settings = corpus.settings
    if settings is None:
        raise SystemExit(f"{args.corpus}: no generation settings in its manifest (greedy or sampled at which "
                         f"temperature?)")
    seqs = corpus.read("train")[:args.sequences]

    def texts():
        for s in tqdm(seqs, desc="chain rates", unit="seq"):
            start = s.loss_mask.index(1) if 1 in s.loss_mask else len(s.input_ids)
            yield s.input_ids[:start], s.input_ids[start:], len(s.input_ids) - start

    t0 = time.perf_counter()
    cal = ChainCalibration.fit_texts(texts(), {"corpus": args.corpus}, max_ngram=args.max_ngram,
                                     max_tokens=args.tokens, temperature=settings.temperature)
    cal.save(args.out)
    print(f"{len(seqs)} sequences at T={settings.temperature:g}, {cal.samples[0]} roots with a match, "
          f"{time.perf_counter() - t0:.0f} s -> {args.out}")


if __name__ == "__main__":
    main()
