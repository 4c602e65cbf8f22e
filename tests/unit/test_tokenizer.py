import subprocess
import sys

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from p2p_diloco.config import ConfigError, TokenizerConfig
from p2p_diloco.training.tokenizer import build_tokenizer, vocab_size

pytestmark = pytest.mark.unit

TEXTS = [
    "",
    "hello world",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\r\n\n",
    "naïve café — “quotes” ½ ∑ 日本語 한국어 עברית 🎉👩‍👩‍👧",
    "e\u0301 combining, \x00 nul, \x7f del, \u200b zero width",
    "def f(x):\n    return x ** 2  # code\n",
]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(TokenizerConfig("byte"))


def test_byte_vocab_and_special_tokens(tok):
    assert isinstance(tok, PreTrainedTokenizerFast)
    assert vocab_size(tok) == len(tok) == 257
    assert tok.eos_token == tok.bos_token == tok.pad_token == "<|endoftext|>"
    assert tok.eos_token_id == tok.bos_token_id == tok.pad_token_id == 256


@pytest.mark.parametrize("text", TEXTS)
def test_byte_ids_are_utf8_bytes_and_round_trip(tok, text):
    ids = tok(text)["input_ids"]
    assert ids == list(text.encode("utf-8"))  # also: no special tokens added
    assert tok.decode(ids) == text


def test_every_byte_value_is_its_own_token(tok):
    assert tok.convert_tokens_to_ids(tok.convert_ids_to_tokens(list(range(256)))) == list(range(256))
    assert len(set(tok.convert_ids_to_tokens(list(range(257))))) == 257


def test_save_and_reload_with_auto_tokenizer(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    assert len(again) == 257 and again.eos_token_id == 256 and again.pad_token_id == 256
    for text in TEXTS:
        assert again(text)["input_ids"] == tok(text)["input_ids"]
    # A saved tokenizer directory is also a valid tokenizer.name_or_path.
    loaded = build_tokenizer(TokenizerConfig(str(tmp_path)))
    assert loaded(TEXTS[4])["input_ids"] == list(TEXTS[4].encode())


def test_ids_are_identical_in_another_process(tok):
    code = (
        "import sys; from p2p_diloco.training.tokenizer import build_tokenizer; "
        "from p2p_diloco.config import TokenizerConfig;"
        "t = build_tokenizer(TokenizerConfig()); print(t(sys.argv[1])['input_ids'], t.backend_tokenizer.to_str())"
    )
    text = TEXTS[4] + " <|endoftext|> tail"
    out = subprocess.run([sys.executable, "-c", code, text], capture_output=True, text=True, check=True).stdout
    ids = tok(text)["input_ids"]
    assert ids[-6] == 256  # the literal special token maps to eos
    assert out.strip() == f"{ids} {tok.backend_tokenizer.to_str()}"


def _save_wordlevel(path, **special):
    from tokenizers import Tokenizer, models, pre_tokenizers

    core = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2, "</s>": 3}, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", **special).save_pretrained(path)


def test_pretrained_without_pad_gets_eos_as_pad(tmp_path):
    _save_wordlevel(tmp_path, eos_token="</s>")
    tok = build_tokenizer(TokenizerConfig(str(tmp_path)))
    assert tok.pad_token_id == tok.eos_token_id == 3
    assert tok("a b a")["input_ids"] == [0, 1, 0]
    assert vocab_size(tok) == 4


def test_pretrained_without_eos_is_rejected(tmp_path):
    _save_wordlevel(tmp_path)
    with pytest.raises(ConfigError, match="no eos token"):
        build_tokenizer(TokenizerConfig(str(tmp_path)))


@pytest.mark.parametrize("name", ["/nonexistent/tokenizer/dir", "__EMPTY__"])
def test_unloadable_tokenizer_is_a_one_line_config_error(tmp_path, name):
    name = str(tmp_path) if name == "__EMPTY__" else name
    with pytest.raises(ConfigError, match=f"^cannot load tokenizer {name}: ") as info:
        build_tokenizer(TokenizerConfig(name))
    assert "\n" not in str(info.value) and "Traceback" not in str(info.value)
