"""The JAX-vLLM offloading seed's per-version admission."""

from __future__ import annotations

from tqstream.controller.admission.base import _check_ints, _Slots, _version
from tqstream.errors import AdmissionError


class PerVersionAdmission(_Slots):
    """JAX-vLLM offloading: at most ``max_per_version`` prompts start under each policy version.

    Only the newest version has a budget: a producer on older weights gets nothing (its samples
    would be stale), and a producer on a newer version than the controller has heard of opens it
    (it can only hold weights the trainer published; the notice may simply arrive later).
    """

    style = "per_version"

    def __init__(self, max_per_version: int, update_interval: int) -> None:
        super().__init__()
        _check_ints("per_version", max_per_version=max_per_version)
        _check_ints("per_version", update_interval=update_interval)
        if update_interval < 1:
            raise AdmissionError(
                f"per_version admission needs update_interval >= 1 (got {update_interval}); set it "
                f"to the number of prompts the trainer consumes per weight update"
            )
        if max_per_version < 1:
            raise AdmissionError(
                f"per_version admission needs max_per_version >= 1 (got {max_per_version}): no "
                f"prompt could start under any version; set it >= update_interval "
                f"({update_interval})"
            )
        if max_per_version < update_interval:
            raise AdmissionError(
                f"per_version admission would deadlock: max_per_version={max_per_version} < "
                f"update_interval={update_interval}: producers stop after {max_per_version} "
                f"prompts under a version while the trainer publishes the next version only after "
                f"{update_interval} prompts, so both wait forever; set max_per_version >= "
                f"{update_interval} (JAX-vLLM's rule MAX_STALENESS >= UPDATE_INTERVAL)"
            )
        self.max_per_version = max_per_version
        self.update_interval = update_interval
        self.admitted = 0  # under self.version, net of rejected refunds

    def try_acquire(self, n: int, version: int) -> list[int]:
        """Up to ``n`` slots within what remains of ``version``'s budget (a partial grant is
        normal: the rest waits for the next version, like vLLM's partial batch)."""
        n = self._check_n(n)
        v = _version(version)
        self.on_version(v)
        if v < self.version:
            return []
        k = min(n, self.max_per_version - self.admitted)
        self.admitted += k
        return self._issue(k, v)

    def _refund(self, tag: int) -> None:
        if tag == self.version:
            self.admitted -= 1

    def on_version(self, version: int) -> None:
        """Open the budget of a newer version; a repeated or late notice is a no-op."""
        v = _version(version)
        if v > self.version:
            self.version = v
            self.admitted = 0

    def on_version_recovered(self, version: int) -> None:
        """A restart at ``version``: its budget is fresh, slots issued before are void."""
        self.version = _version(version)
        self.admitted = 0
        self._void()

    def state(self) -> dict[str, int | float | str]:
        return {
            **self._common(),
            "admitted": self.admitted,
            "remaining": self.max_per_version - self.admitted,
            "max_per_version": self.max_per_version,
            "update_interval": self.update_interval,
        }
