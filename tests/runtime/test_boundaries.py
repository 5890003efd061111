"""runtime/ reads only an engine directory: importing it (and running an engine) never imports torch,
transformers, recipes/ or builder/, nor the HTTP server (runtime/server/) and its web stack."""
import subprocess
import sys

FORBIDDEN = ("torch", "transformers", "engine.recipes", "engine.builder", "engine.runtime.server", "fastapi",
             "uvicorn", "starlette")


def test_runtime_imports_no_torch_build_code_nor_web_stack(tiny_engine):
    code = (
        "import sys\n"
        "from engine.runtime import LLM, SamplingParams\n"
        f"llm = LLM({str(tiny_engine[1])!r}, max_kv_tokens=64)\n"
        "llm.generate(['hello'], SamplingParams(max_tokens=2))\n"
        f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r} or m in {FORBIDDEN!r})\n"
        "print(bad)\n"
        "assert not bad, bad\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:] + r.stdout
