"""systemd's notify protocol, spoken directly: one datagram to the AF_UNIX socket in
$NOTIFY_SOCKET (a leading `@` means the abstract namespace). Outside systemd it does nothing."""

from __future__ import annotations

import os
import socket


class Notifier:
    """READY=1, STATUS=..., WATCHDOG=1 (at half of WatchdogSec), STOPPING=1."""

    def __init__(self, environ: dict[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        self.address = env.get("NOTIFY_SOCKET") or None
        usec = env.get("WATCHDOG_USEC")
        pid = env.get("WATCHDOG_PID")
        watchdog_for_us = usec and usec.isdigit() and (not pid or pid == str(os.getpid()))
        self.watchdog_interval = int(usec) / 1e6 / 2 if watchdog_for_us and usec else None
        self._last_watchdog = 0.0

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, *fields: str) -> bool:
        if not self.address:
            return False
        addr = "\0" + self.address[1:] if self.address.startswith("@") else self.address
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
                s.connect(addr)
                s.sendall("\n".join(fields).encode())
        except OSError:
            return False  # systemd went away; nothing to tell
        return True

    def ready(self, status: str) -> None:
        self.send("READY=1", f"STATUS={status}")

    def status(self, status: str) -> None:
        self.send(f"STATUS={status}")

    def stopping(self) -> None:
        self.send("STOPPING=1")

    def watchdog_due(self, now: float) -> float | None:
        """When the next WATCHDOG=1 is due (None without a watchdog)."""
        if self.watchdog_interval is None:
            return None
        return self._last_watchdog + self.watchdog_interval

    def watchdog(self, now: float) -> None:
        due = self.watchdog_due(now)
        if due is not None and now >= due:
            self.send("WATCHDOG=1")
            self._last_watchdog = now
