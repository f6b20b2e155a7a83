"""Token weights of the advantage shapers (THR, OAR), composed by multiplication."""

from __future__ import annotations

import torch

from rlvr_lightning.context import AdvantageShaper, ScoredBatch, StepContext
from rlvr_lightning.models.forward import response_hidden


def compose_token_weights(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    """a · b, the narrower one padded with weight 1 (a shaper may weigh only a response prefix)."""
    if a is None or b is None:
        return b if a is None else a
    T = max(a.shape[1], b.shape[1])
    pad = lambda w: torch.nn.functional.pad(w, (0, T - w.shape[1]), value=1.0)  # noqa: E731
    return pad(a) * pad(b)


def rollout_token_weights(step: StepContext, batch: ScoredBatch, shapers: list[AdvantageShaper]) -> torch.Tensor | None:
    """Every shaper's `token_weights` for a new rollout batch, composed; None when none weighs."""
    weights = None
    for shaper in shapers:
        weights = compose_token_weights(weights, shaper.token_weights(step, batch))
    return weights


class HiddenWeigher:
    """Turns θ_old's LM-head inputs into the weights of the shapers that read them (THR)."""

    def __init__(self, step: StepContext, batch: ScoredBatch, readers: list[AdvantageShaper], needed) -> None:
        self.step, self.batch, self.readers = step, batch, readers
        self.needed = needed  # bool [N] (host): the union of the readers' rows, whole groups

    def needs_any(self, rows: torch.Tensor) -> bool:
        return bool(self.needed[rows.cpu()].any())

    def hidden_of(self, lm_head_in: torch.Tensor, rows: torch.Tensor, response_mask: torch.Tensor):
        """{sequence n: [L_n, d]} of the needed sequences among a forward's `rows`."""
        need = self.needed[rows.cpu()].tolist()
        return response_hidden(lm_head_in, [int(n) if k else None for n, k in zip(rows.tolist(), need)], response_mask)

    def weights(self, hidden: dict[int, torch.Tensor], rows: list[int], width: int) -> torch.Tensor:
        """Weights [len(rows), width] of the sequences `rows` from `hidden` (whole groups); 1 elsewhere."""
        weights = torch.ones(len(rows), width)
        position = {n: i for i, n in enumerate(rows)}
        for reader in self.readers:
            for n, w in reader.weights_from_hidden(self.step, self.batch, hidden).items():
                weights[position[n], : len(w)] *= w.cpu()
        return weights


def hidden_weigher(step: StepContext, batch: ScoredBatch, shapers: list[AdvantageShaper]) -> HiddenWeigher | None:
    """The weigher for the shapers that read LM-head inputs this batch; None when none does."""
    readers, needed = [], None
    for shaper in shapers:
        rows = shaper.hidden_rows(batch)
        if rows is not None:
            readers.append(shaper)
            needed = rows.bool().cpu() if needed is None else needed | rows.bool().cpu()
    return HiddenWeigher(step, batch, readers, needed) if readers else None


def shaper_metrics(shapers: list[AdvantageShaper]) -> dict[str, float]:
    """The shapers' metrics of the batch just updated on."""
    return {k: v for shaper in shapers for k, v in shaper.batch_metrics().items()}
