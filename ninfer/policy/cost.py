"""The source cost model (seed: 候选按"恢复传输成本 + 剩余 prefill 成本"排序).

Restore cost is the bytes a source must read back (Host→Device) over the measured copy
bandwidth; remaining cost is the tokens still to prefill times the measured per-token prefill
time. Calibration changes the order of candidates, never whether a candidate is restorable.
Defaults are rough CPU figures; ``calibrate`` replaces them with measurements.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CostModel:
    h2d_bytes_per_s: float = 4e9          # CPU memcpy; ~50e9 for pinned PCIe Gen5
    prefill_s_per_token: float = 2e-4     # tiny model, one CPU thread
    fixed_bind_s: float = 1e-4

    def restore_s(self, h2d_bytes: int) -> float:
        return self.fixed_bind_s + h2d_bytes / self.h2d_bytes_per_s

    def prefill_s(self, tokens: int) -> float:
        return tokens * self.prefill_s_per_token

    def source_cost(self, h2d_bytes: int, remaining_tokens: int) -> float:
        return self.restore_s(h2d_bytes) + self.prefill_s(remaining_tokens)

    def calibrate(self, h2d_bytes_per_s: float | None = None, prefill_s_per_token: float | None = None) -> None:
        if h2d_bytes_per_s:
            self.h2d_bytes_per_s = h2d_bytes_per_s
        if prefill_s_per_token:
            self.prefill_s_per_token = prefill_s_per_token
