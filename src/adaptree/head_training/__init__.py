"""EAGLE-3 draft-head training (``adaptree train-head``).

- :mod:`.corpus`: training sequences (self-distilled with batched generation, or ShareGPT) with a
  response loss mask; evaluation prompts excluded.
- :mod:`.features`: the target's features / final hidden states / greedy tokens, memory-mapped on disk,
  resumable.
- :mod:`.ttt`: the training-time test (K unrolled draft steps seeing exactly what inference sees) and
  its loss.
- :mod:`.trainer`: the typed config, the trainer (AdamW, warm-up + cosine, clipping, checkpoints,
  validation) and the whole pipeline :func:`train_head`.
"""

from adaptree.head_training.corpus import (ConversationItem, TokenSequence, build_corpus, read_corpus,
                                           render_conversation)
from adaptree.head_training.features import FeatureStore, extract_features
from adaptree.head_training.trainer import HeadTrainer, TrainHeadConfig, train_head
from adaptree.head_training.ttt import collate, ttt_forward, ttt_loss

__all__ = [
    "ConversationItem", "TokenSequence", "build_corpus", "read_corpus", "render_conversation",
    "FeatureStore", "extract_features", "HeadTrainer", "TrainHeadConfig", "train_head",
    "collate", "ttt_forward", "ttt_loss",
]
