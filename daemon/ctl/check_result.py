"""One finding of `specctl doctor` (doctor.py, doctor_ranks.py): a check's name, whether it
passed, what it saw, and what to do when it did not."""

from __future__ import annotations

import msgspec


class CheckResult(msgspec.Struct, frozen=True):
    name: str
    ok: bool
    detail: str
    advice: str = ""
