"""Where an evaluation cuts a long token sequence: perplexity's sliding windows and the
prompt set of agreement/KL. Index arithmetic only (ints in, ints out).

Sliding windows (Hugging Face's perplexity recipe: windows of `window` tokens every
`stride` tokens; each scores only the tokens no earlier window scored, with as much left
context as the window allows). Token t is "scored" when the model predicts it from the
tokens before it inside its window, so token 0 never is and every other token exactly
once (stride < window: a window must overlap the one before, else the token at its
start has no context inside it and nobody scores it):

    tokens      0 1 2 3 4 5 6 7 8 9          n = 10, window = 6, stride = 3
    window 0    [0 . . . . 5]                scores 1..5   (begin 0, end 6, first_scored 1)
    window 1          [3 . . . . 8]          scores 6..8   (begin 3, end 9, first_scored 6)
    window 2                [6 . . 9]        scores 9      (begin 6, end 10, first_scored 9)

Window k begins at k * stride and ends at min(begin + window, n); it scores
[max(previous end, begin + 1), end); the last one is the first to reach n.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Window:
    """tokens [begin, end) are the model's input; targets [first_scored, end) are scored
    (target t from the row of position t - 1)."""

    begin: int
    end: int
    first_scored: int

    @property
    def num_scored(self) -> int:
        return self.end - self.first_scored


def sliding_windows(num_tokens: int, window: int, stride: int) -> list[Window]:
    """The perplexity windows of a sequence of num_tokens tokens (see the module doc);
    ValueError naming window or stride unless 2 <= window and 1 <= stride < window, or
    when num_tokens < 2 (nothing to score)."""
    if not isinstance(window, int) or window < 2:
        raise ValueError(f"window must be an integer >= 2, got {window!r}")
    if not isinstance(stride, int) or not 1 <= stride < window:
        raise ValueError(f"stride must be an integer in [1, window - 1 = {window - 1}] (windows must overlap, "
                         f"else tokens go unscored), got {stride!r}")
    if num_tokens < 2:
        raise ValueError(f"the text has {num_tokens} token(s); at least 2 are needed to score one")
    windows: list[Window] = []
    prev_end = 0
    for begin in range(0, num_tokens, stride):
        end = min(begin + window, num_tokens)
        windows.append(Window(begin, end, max(prev_end, begin + 1)))
        prev_end = end
        if end == num_tokens:
            break
    return windows


def prompt_windows(num_tokens: int, num_prompts: int, prompt_len: int) -> list[tuple[int, int]]:
    """Agreement/KL's prompt set: up to num_prompts consecutive, non-overlapping windows
    [k * prompt_len, (k + 1) * prompt_len) that fit in num_tokens. ValueError naming the
    field for num_prompts < 1 or prompt_len < 2, or when not one window fits."""
    if not isinstance(num_prompts, int) or num_prompts < 1:
        raise ValueError(f"num_prompts must be an integer >= 1, got {num_prompts!r}")
    if not isinstance(prompt_len, int) or prompt_len < 2:
        raise ValueError(f"prompt_len must be an integer >= 2, got {prompt_len!r}")
    count = min(num_prompts, num_tokens // prompt_len)
    if count == 0:
        raise ValueError(f"the text has {num_tokens} tokens, fewer than one prompt of prompt_len={prompt_len}")
    return [(k * prompt_len, (k + 1) * prompt_len) for k in range(count)]
