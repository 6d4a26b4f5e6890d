"""worker/verified_calls.py: a compiled method runs dynamo's guard check once per key (the inputs' dtypes, shapes,
strides, the thread count), then skips it; any new key goes back through the guarded call, which recompiles
where the guards demand it; results always equal the eager method's."""

import torch

from deepinfer.worker import verified_calls
from deepinfer.worker.compiled_step import _own_code
from deepinfer.worker.verified_calls import VerifiedCalls, call_key


class _Toy:
    def __init__(self):
        self.weight = torch.nn.Parameter(torch.randn(4, 4), requires_grad=False)
        own = _own_code(self._forward)
        self.fn = VerifiedCalls(own, torch.compile(own, dynamic=True, fullgraph=True))

    def _forward(self, x, scale: int):
        return (x @ self.weight).relu() * scale


def _check(toy: _Toy, x: torch.Tensor, scale: int = 2) -> None:
    torch.testing.assert_close(toy.fn(x, scale), toy._forward(x, scale), rtol=0, atol=0)


def test_guards_are_checked_once_per_key_then_skipped():
    toy = _Toy()
    _check(toy, torch.randn(3, 4))
    assert (toy.fn.guarded, toy.fn.direct) == (1, 0)
    for _ in range(3):  # new values, same key
        _check(toy, torch.randn(3, 4))
    assert (toy.fn.guarded, toy.fn.direct) == (1, 3)
    _check(toy, torch.randn(5, 4))  # a new shape: one guarded call, then direct
    _check(toy, torch.randn(5, 4))
    assert (toy.fn.guarded, toy.fn.direct) == (2, 4)


def test_every_key_part_sends_a_call_back_through_the_guards():
    toy = _Toy()
    _check(toy, torch.randn(6, 4))
    _check(toy, torch.randn(6, 4), scale=3)  # another int argument
    _check(toy, torch.randn(4, 6).t())  # the same shape, other strides
    _check(toy, torch.randn(6, 4)[::2])
    with torch.inference_mode():  # an inference tensor (and another grad mode)
        _check(toy, torch.randn(6, 4))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads > 1 else 2)  # dynamo guards on the thread count: a recompile
        _check(toy, torch.randn(6, 4))
    finally:
        torch.set_num_threads(threads)
    assert (toy.fn.guarded, toy.fn.direct, len(toy.fn.verified)) == (6, 0, 6)
    x = torch.randn(6, 4)
    assert call_key((x, 2)) != call_key((x.double(), 2))


def test_without_the_private_hook_every_call_is_guarded(monkeypatch):
    monkeypatch.setattr(verified_calls, "_cache_entries", None)
    toy = _Toy()
    for _ in range(3):
        _check(toy, torch.randn(2, 4))
    assert (toy.fn.guarded, toy.fn.direct) == (3, 0)


def test_the_oldest_keys_are_dropped_past_the_limit(monkeypatch):
    monkeypatch.setattr(verified_calls, "MAX_KEYS", 2)
    toy = _Toy()
    for rows in (1, 2, 3, 1):  # 1 was dropped when 3 came: guarded again
        _check(toy, torch.randn(rows, 4))
    assert toy.fn.guarded == 4 and [k[0][0][1][0] for k in toy.fn.verified] == [3, 1]
