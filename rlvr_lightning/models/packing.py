"""Where a micro-batch's real tokens go when its sequences are packed into one row (padding-free).

`RolloutTensors` lays a micro-batch out as [n, P+T]: prompts left-padded to the longest prompt P,
responses right-padded to the longest response T. Packed, the same forward runs over one row [1, S]
holding each sequence's real prompt and real response back to back (S = Σ prompt + response), with
positions restarting at 0 per sequence: the positions the padded layout and the engine use, so each
token sees the same context at the same position. Transformers recognises packed sequences from
such position ids when no attention mask is given (block-diagonal causal attention); varlen kernels
read the same boundaries from `cu_seqlens`.

Everything here is index arithmetic on the host, from the [n, 2] token counts the micro-batch layout
already holds, so building a layout costs no device work and no device-to-host sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PackedLayout:
    token_index: torch.Tensor  # [S] flat indices into input_ids [n, P+T] of the real tokens, sequence by sequence
    position_ids: torch.Tensor  # [1, S] 0 at each sequence's first token
    predicting: torch.Tensor  # [M] packed positions whose hidden state predicts a response token, row-major
    response_row: torch.Tensor  # [M] the sequence of each of those response tokens ...
    response_col: torch.Tensor  # [M] ... and its column t in the [n, T] response grid
    cu_seqlens: torch.Tensor  # [k+1] int32: where each of the k non-empty sequences starts in the row, then S
    max_length: int  # the longest sequence (varlen kernels need it)
    shape: tuple[int, int]  # (n, T) of the response grid

    @property
    def real_tokens(self) -> int:
        return int(self.token_index.numel())


def packed_layout(
    token_counts: torch.Tensor, prompt_width: int, response_width: int, device: torch.device | str | None = None
) -> PackedLayout:
    """The packed layout of n sequences with these [n, 2] (prompt, response) real tokens, laid out as
    `RolloutTensors` does (prompts right-aligned in the first `prompt_width` columns, responses from
    column `prompt_width`, `response_width` wide). Response token t of a sequence with p prompt tokens
    is predicted by its token p − 1 + t, so every sequence with a response needs a prompt token."""
    counts = token_counts.detach().to("cpu", torch.long)
    if counts.dim() != 2 or counts.shape[1] != 2:
        raise ValueError(f"token_counts must be [n, 2] (prompt, response) tokens, got {tuple(counts.shape)}")
    prompt, response = counts.unbind(1)
    if bool((prompt > prompt_width).any() | (response > response_width).any()):
        raise ValueError(
            f"token counts exceed the layout's {prompt_width} prompt and {response_width} response columns"
        )
    if bool(((prompt == 0) & (response > 0)).any()):
        raise ValueError("a sequence with a response but no prompt token: nothing predicts its first response token")
    n, width = len(counts), prompt_width + response_width
    lengths = prompt + response
    starts = lengths.cumsum(0) - lengths  # where each sequence begins in the packed row
    row = torch.repeat_interleave(torch.arange(n), lengths)  # [S] the sequence of every packed token
    offset = torch.arange(int(lengths.sum())) - starts[row]  # its position within its sequence
    token_index = row * width + (prompt_width - prompt[row]) + offset
    resp_row = torch.repeat_interleave(torch.arange(n), response)  # [M] the sequence of every response token
    t = torch.arange(int(response.sum())) - (response.cumsum(0) - response)[resp_row]
    predicting = starts[resp_row] + prompt[resp_row] - 1 + t
    nonempty = lengths[lengths > 0]
    cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.long), nonempty.cumsum(0)]).to(torch.int32)
    return PackedLayout(
        token_index.to(device),
        offset[None].to(device),
        predicting.to(device),
        resp_row.to(device),
        t.to(device),
        cu_seqlens.to(device),
        int(nonempty.max()) if len(nonempty) else 0,
        (n, response_width),
    )
