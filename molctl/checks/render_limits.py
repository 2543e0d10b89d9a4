"""The bounds of one sandboxed template render, shared by the renderer (`checks.template`) and
the sandbox that enforces them inside Jinja (`checks.jinja_sandbox`)."""

from __future__ import annotations

import re

MAX_OUTPUT = 4 * 1024 * 1024  # characters of one rendered prompt (a real one is kilobytes)
# the widths and precisions of printf-style and str.format format strings (a huge one allocates it)
PERCENT_WIDTHS = re.compile(r"%(?:\([^)]*\))?[#0 +-]*(\d+)?(?:\.(\d+))?")
BRACE_WIDTHS = re.compile(r"\{[^{}]*:[^{}]*?(\d+)(?:\.(\d+))?[^{}]*\}")
RENDER_TIMEOUT_S = 5.0  # of one render (a real one takes milliseconds)
