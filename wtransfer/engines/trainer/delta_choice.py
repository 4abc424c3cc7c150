"""``delta="auto"``: before each round, choose a delta or a dense round from what earlier rounds measured.

A delta round reads the trainer's base beside the new values and hashes both, so it costs about one pass
over the model at the encoder's rate whatever changed; a dense round costs the model at the link's rate.
Deltas pay only where the link is slower than the encoder. The choice uses three measurements: the
fastest dense round (model bytes per second of the whole round: the link as the caller sees it), the last
delta round's rate (the fraction changed and the encoder's speed both show in it), and refusals (a worker
that cannot apply deltas gets every delta round whole, after an encoding spent for nothing).

Rules, in order:

1. The first two rounds are dense: a dense round allocates no base, and the link is measured from the second
   (the first pays one-time costs, connections and allocations, and can make a fast link look slow).
2. A link at least :data:`DELTA_BELOW` fast stays dense: near the encoder's own rate a delta gains little or
   loses (a cautious threshold, well below where delta stops paying).
   So do rounds shorter than :data:`SHORTEST_FOR_DELTA`: their time is the calls' fixed costs, not the wire.
3. A delta round that ran slower than the fastest dense round sends the next rounds dense (the base is
   dropped, its memory freed); so do :data:`REFUSALS_TO_STOP` refusals in a row.
4. Otherwise (a slow link): delta. Entering delta, the first round sends everything while it fills the base
   (on a slow link the copy hides under the wire). After leaving it, delta is tried again after 2, 4, 8 ...
   (at most :data:`LONGEST_WAIT`) dense rounds, as the fraction changed per step may fall during training; a
   delta round that wins starts the count again.

The link is measured only by dense rounds; the comparison (the last delta round against the fastest dense one)
leans to dense. A link that was fast once stays dense: never slower than dense, though a link that slows later
would not be noticed. ``reconnect()`` starts the measurements again (its workers may be behind another link).
"""

from __future__ import annotations

from dataclasses import dataclass

DELTA_BELOW = 0.5e9
"""Model bytes/s of a dense round (4 Gbit/s) under which delta rounds are tried. Well below the rate where a
delta stopped paying on both 2-core hosts the delta bench has run on, an AMD EPYC and the Intel Xeon with AMX of
BENCHMARKS.md's block (over 10 Gbit/s it gained nothing on either);
far enough below it that the round that fills the base hides its copy under the wire."""

SHORTEST_FOR_DELTA = 0.25
"""Seconds a dense round must take before deltas are tried: a shorter one is mostly the fixed cost of the client
calls and control messages, which a delta round pays too (and a delta saves little time there whatever it saves)."""

LONGEST_WAIT = 64
"""Dense rounds at most between two tries of delta."""

REFUSALS_TO_STOP = 2
"""Delta rounds refused in a row (each sent whole after its encoding) before rounds go dense. One refusal is
normal: a restarted worker refuses once and takes deltas again after its whole round."""


@dataclass
class DeltaChoice:
    """What the trainer measured, and the choice it makes from it (:meth:`choose`)."""

    dense_rounds: int = 0
    """Dense rounds committed."""
    dense_rate: float | None = None
    """Model bytes/s of the fastest dense round after the first; None until one ran."""
    dense_seconds: float = 0.0
    """That round's time."""
    delta_rate: float | None = None
    """Model bytes/s of the last delta round against a base; None until one ran."""
    in_delta: bool = False
    """The last choice was delta."""
    refusals: int = 0
    """Delta rounds refused in a row."""
    losses: int = 0
    """Times delta was left because it lost; the wait before trying again doubles with each."""
    wait: int = 0
    """Dense rounds to run before delta is tried again."""

    def choose(self) -> tuple[str, str]:
        """``("delta" | "dense", why)`` for the next round."""
        if self.dense_rate is None:
            return self._dense("the first two rounds are dense: the second measures the link")
        link = f"dense rounds ran at {_rate(self.dense_rate)}"
        if self.dense_rate >= DELTA_BELOW:
            return self._dense(f"{link}, faster than encoding a delta pays for (at least {_rate(DELTA_BELOW)})")
        if self.dense_seconds < SHORTEST_FOR_DELTA:
            return self._dense(f"dense rounds take {self.dense_seconds:.3f} s, mostly fixed costs a delta pays too "
                               f"(under {SHORTEST_FOR_DELTA} s)")
        if self.in_delta:
            if self.refusals >= REFUSALS_TO_STOP:
                return self._leave(f"{self.refusals} delta rounds in a row were refused by a worker")
            if self.delta_rate is not None and self.delta_rate < self.dense_rate:
                return self._leave(f"the last delta round ran at {_rate(self.delta_rate)}; {link}")
            measured = "" if self.delta_rate is None else f", the last delta round at {_rate(self.delta_rate)}"
            return "delta", f"{link}{measured}"
        if self.wait > 0:
            self.wait -= 1
            again = "next round" if self.wait == 0 else f"after {self.wait} more dense round(s)"
            return "dense", f"the last delta round lost; delta is tried again {again}"
        self.in_delta, self.refusals, self.delta_rate = True, 0, None
        return "delta", f"{link}, slower than delta encoding: the base is filled this round"

    def _dense(self, why: str) -> tuple[str, str]:
        self.in_delta = False
        return "dense", why

    def _leave(self, why: str) -> tuple[str, str]:
        self.losses += 1
        self.wait = min(2 ** self.losses, LONGEST_WAIT) - 1  # this round is the first of the 2, 4, 8 ... dense rounds
        return self._dense(why)

    def dense_round(self, model_bytes: int, seconds: float) -> None:
        """A dense round committed."""
        self.dense_rounds += 1
        if self.dense_rounds > 1 and seconds > 0 and model_bytes / seconds > (self.dense_rate or 0.0):
            self.dense_rate, self.dense_seconds = model_bytes / seconds, seconds

    def delta_round(self, sent: str, model_bytes: int, seconds: float, refused: bool) -> None:
        """A round of a delta trainer committed: ``sent`` is ``"delta"`` or ``"full"`` (no base yet)."""
        self.refusals = self.refusals + 1 if refused else 0
        if sent == "delta" and not refused and seconds > 0:
            self.delta_rate = model_bytes / seconds
            if self.dense_rate is not None and self.delta_rate >= self.dense_rate:
                self.losses = 0  # it wins: after a later loss, delta is tried again soon


def _rate(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1e9:.2f} GB/s" if bytes_per_s >= 1e9 else f"{bytes_per_s / 1e6:.1f} MB/s"
