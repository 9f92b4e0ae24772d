"""The Conf-KV benchmark's settings (token counts of each part, sample counts), `QUICK`'s tiny ones
for tests, and `--set NAME=INT` overrides; the decode-block and Fast KVzip decode benchmarks read
at the same settings."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Settings:
    prefix: int = 320  # tokens prefilled (after the BOS) before the read (> every budget)
    continuation: int = 512  # tokens read one by one
    texts: int = 2
    tight: int = 96
    loose: int = 192
    protected: int = 40  # < tight * gamma_min for the pyramid (the default 64 would not fit)
    needle_length: int = 1024
    needle_samples: int = 4
    needle_tight: int = 256
    needle_loose: int = 512
    kl_texts: int = 2
    kl_points: int = 24  # query positions per text
    kl_length: int = 768
    kl_ablated: int = 256
    bins: int = 4
    ablation_texts: int = 12
    ablation_continuation: int = 256  # after the same `prefix`
    bootstrap: int = 2000  # resamples of the texts for the gap-closed interval


QUICK = Settings(
    prefix=128,
    continuation=64,
    texts=1,
    tight=48,
    loose=96,
    protected=16,
    needle_length=256,
    needle_samples=1,
    needle_tight=96,
    needle_loose=128,
    kl_texts=1,
    kl_points=4,
    kl_length=320,
    kl_ablated=64,
    bins=2,
    ablation_texts=2,
    ablation_continuation=32,
    bootstrap=200,
)


def with_overrides(base: Settings, assignments: list[str]) -> Settings:
    """`base` with NAME=VALUE overrides (integers)."""
    fields = {field.name for field in dataclasses.fields(Settings)}
    values = {}
    for assignment in assignments:
        name, _, value = assignment.partition("=")
        if name not in fields or not value:
            raise SystemExit(f"--set {assignment!r}: expected NAME=INT, NAME one of {fields}")
        values[name] = int(value)
    return dataclasses.replace(base, **values)
