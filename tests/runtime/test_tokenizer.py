"""The runtime tokenizer and chat templates against transformers (the reference; runtime/ never imports it)."""
import json
import shutil

import pytest

from engine.core.errors import EngineError
from engine.runtime import Tokenizer

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France? café 東京"},
            {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And Japan?"}]


def test_encode_decode_match_transformers(tiny_tok_dir):
    from transformers import AutoTokenizer
    ref = AutoTokenizer.from_pretrained(tiny_tok_dir)
    tok = Tokenizer(tiny_tok_dir)
    text = "The capital of France is Paris. naïve 🙂"
    assert tok.encode(text) == ref(text)["input_ids"]
    assert tok.decode(tok.encode(text)) == ref.decode(ref(text)["input_ids"], skip_special_tokens=True)
    assert tok.eos_token_id == ref.eos_token_id and tok.bos_token_id == ref.bos_token_id


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tiny_tok_dir, add_generation_prompt):
    from transformers import AutoTokenizer
    ref = AutoTokenizer.from_pretrained(tiny_tok_dir)
    tok = Tokenizer(tiny_tok_dir)
    want = ref.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert tok.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt) == want
    ids = ref.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=add_generation_prompt)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert tok.encode_chat(MESSAGES, add_generation_prompt=add_generation_prompt) == list(ids)


TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'tool' %}"
            "{{ raise_exception('tool messages are not supported') }}{% endif %}"
            "[{{ m['role'] }}] {{ m['content'] | tojson }}\n{% endfor %}{{ eos_token }}")


def test_template_file_globals_and_raise_exception(tiny_tok_dir, tmp_path):
    from transformers import AutoTokenizer
    d = tmp_path / "tok"
    shutil.copytree(tiny_tok_dir, d)
    (d / "chat_template.jinja").write_text(TEMPLATE)  # takes precedence over tokenizer_config's template
    ref = AutoTokenizer.from_pretrained(d)
    tok = Tokenizer(d)
    assert tok.apply_chat_template(MESSAGES) == ref.apply_chat_template(MESSAGES, tokenize=False,
                                                                        add_generation_prompt=True)
    assert tok.apply_chat_template(MESSAGES).startswith("<s>[system]")
    assert "東京" in tok.apply_chat_template(MESSAGES)  # tojson keeps non-ASCII, as transformers does
    with pytest.raises(EngineError, match="tool messages are not supported"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_missing_template_and_tokenizer(tiny_tok_dir, tmp_path):
    d = tmp_path / "tok"
    shutil.copytree(tiny_tok_dir, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    cfg["add_bos_token"] = True
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = Tokenizer(d)
    assert tok.encode("hi")[0] == tok.bos_token_id
    with pytest.raises(EngineError, match="no chat template"):
        tok.apply_chat_template(MESSAGES)
    with pytest.raises(EngineError, match="tokenizer.json does not exist"):
        Tokenizer(tmp_path)
