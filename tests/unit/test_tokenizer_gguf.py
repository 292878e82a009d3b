"""SmolLM2's tokenizer is built from the GGUF without torch (the front's image has none), and it is
the tokenizer transformers' own GGUF loading (which needs torch) makes."""
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_gguf_tokenizer_needs_no_torch_and_matches_autotokenizers(tmp_path):
    ours = tmp_path / "ours"
    code = textwrap.dedent(f"""
        import sys
        sys.modules["torch"] = None  # any import of torch fails
        from ampd.engine.torch_models import _gguf_tokenizer
        _gguf_tokenizer().save_pretrained({str(ours)!r})
    """)
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]

    from transformers import AutoTokenizer

    from ampd.engine.torch_models import smollm2_gguf

    gguf = smollm2_gguf()
    ref = tmp_path / "ref"
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True).save_pretrained(ref)
    for name in ("tokenizer.json", "chat_template.jinja"):
        assert (ours / name).read_bytes() == (ref / name).read_bytes(), name
