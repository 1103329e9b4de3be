"""An engine's logs from journald (journalctl), for failures and the admin API."""

from __future__ import annotations

import asyncio


class Journalctl:
    def __init__(self, manager: str = "system") -> None:
        self._unit_flag = "--user-unit" if manager == "user" else "--unit"

    async def tail(self, unit: str, lines: int) -> list[str]:
        try:
            proc = await asyncio.create_subprocess_exec(
                "journalctl", self._unit_flag, unit, "-n", str(lines), "-o", "short-iso",
                "--no-pager", "--quiet", stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE)
        except OSError as e:
            return [f"(journal unavailable: {e})"]
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout=10)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            return ["(journalctl did not answer in 10 s)"]
        if proc.returncode != 0:
            return [f"(journalctl failed: {err.decode(errors='replace').strip()})"]
        return out.decode(errors="replace").splitlines()
