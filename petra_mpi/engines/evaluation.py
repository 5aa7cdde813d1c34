"""Evaluation totals: summed loss and top-1/top-5 hits, so ranks and batches add up exactly."""
from dataclasses import dataclass

import torch.nn.functional as F


@dataclass
class EvalTotals:
    loss_sum: float = 0.0
    top1: int = 0
    top5: int = 0
    count: int = 0

    def add(self, logits, labels):
        self.loss_sum += F.cross_entropy(logits.float(), labels, reduction="sum").item()
        k = min(5, logits.shape[1])
        top = logits.topk(k, dim=1).indices
        hits = top == labels[:, None]
        self.top1 += int(hits[:, 0].sum())
        self.top5 += int(hits.any(dim=1).sum())
        self.count += len(labels)

    def result(self) -> dict:
        n = max(1, self.count)
        return {"val_loss": self.loss_sum / n, "val_acc": self.top1 / n, "val_top5": self.top5 / n,
                "val_count": self.count}


def correct(logits, labels) -> int:
    return int((logits.argmax(dim=1) == labels).sum())
