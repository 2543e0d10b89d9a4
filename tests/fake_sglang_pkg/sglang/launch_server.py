"""`python -m sglang.launch_server`: starts the scripted fake SGLang (tests/fake_sglang.py)."""

import runpy
from pathlib import Path

if __name__ == "__main__":
    runpy.run_path(str(Path(__file__).resolve().parents[2] / "fake_sglang.py"), run_name="__main__")
