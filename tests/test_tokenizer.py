import json

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from pdserve.common.tokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer, Tokenizer, add_bos_processor

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A naïve café in 東京 serves crème brûlée 🚀 at dawn.",
    "Streaming text must never split a character: 日本語, Ελληνικά, emoji 🎉🚀.",
    "hello world, hello tokenizer",
]
TEXTS = [
    "naïve café 東京 🚀",
    "hello 日本語 and 🎉🎉 then Ελληνικά!",
    "plain ascii only",
    "🚀",
]


def _write_model_dir(path, tokenizer_config=None, generation_config=None, bos_processor=None):
    """bos_processor: tokenizer.json puts BOS in front (as DeepSeek-V3's does); by default when the config says
    add_bos_token."""
    # A small vocabulary (256 bytes + few merges) so that most non-ASCII characters span several tokens.
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=[BOS, EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    if bos_processor if bos_processor is not None else (tokenizer_config or {}).get("add_bos_token"):
        add_bos_processor(tok, BOS)
    tok.save(str(path / "tokenizer.json"))
    if tokenizer_config is not None:
        (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    if generation_config is not None:
        (path / "generation_config.json").write_text(json.dumps(generation_config))
    return path


# As in DeepSeek-V3's tokenizer_config.json: bos as an AddedToken dict, eos as a string here to cover both forms.
DEEPSEEK_STYLE = {
    "add_bos_token": True,
    "add_eos_token": False,
    "bos_token": {"__type": "AddedToken", "content": BOS, "lstrip": False, "normalized": True},
    "eos_token": EOS,
}


@pytest.fixture
def tok(tmp_path):
    return Tokenizer.from_model_dir(_write_model_dir(tmp_path, DEEPSEEK_STYLE))


def test_no_tokenizer_json_means_none(tmp_path):
    assert Tokenizer.from_model_dir(tmp_path) is None


def test_bos_eos_and_round_trip(tok):
    assert tok.bos_token_id == 0 and tok.eos_token_ids == {1}
    assert tok.vocab_size == 300
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
        assert tok.decode(ids) == text
        assert tok.decode(ids, skip_special_tokens=False) == BOS + text


def test_bos_not_doubled_when_text_has_it(tok):
    ids = tok.encode(BOS + "hello")
    assert ids == tok.encode("hello") and ids.count(tok.bos_token_id) == 1


def test_without_config_no_bos(tmp_path):
    tok = Tokenizer.from_model_dir(_write_model_dir(tmp_path))
    assert tok.bos_token_id is None and tok.eos_token_ids == set()
    assert tok.decode(tok.encode("hello 東京")) == "hello 東京"
    assert tok.encode("hello")[0] != 0


TRUTH_TEXTS = TEXTS + ["hello world", "", " leading space", "def f(x):\n    return x"]


@pytest.mark.parametrize("bos_processor", [True, False])
def test_text_is_encoded_as_transformers_encodes_it(tmp_path, bos_processor):
    """One tokenization: the ids a client's AutoTokenizer gives for a text are the server's for that text."""
    from transformers import AutoTokenizer

    model_dir = _write_model_dir(tmp_path, {**DEEPSEEK_STYLE, "add_bos_token": bos_processor})
    ours, theirs = Tokenizer.from_model_dir(model_dir), AutoTokenizer.from_pretrained(str(model_dir))
    assert ours.add_bos_token == bos_processor
    for text in TRUTH_TEXTS:
        assert ours.encode(text) == theirs(text).input_ids == ours.encode(text, release_gil=True), text


def test_the_demo_model_tokenizes_as_transformers_does(trained_model_dir):
    """models/tiny-trained: AutoTokenizer adds the BOS the server adds (it gave ids without it)."""
    from transformers import AutoTokenizer

    ours, theirs = Tokenizer.from_model_dir(trained_model_dir), AutoTokenizer.from_pretrained(str(trained_model_dir))
    for text in TRUTH_TEXTS:
        assert ours.encode(text) == theirs(text).input_ids, text
    assert ours.encode("hello world")[0] == ours.bos_token_id == theirs.bos_token_id


def test_a_config_that_disagrees_with_tokenizer_json_is_named(tmp_path, caplog):
    """add_bos_token true in tokenizer_config.json, no BOS post-processor in tokenizer.json: transformers adds no
    BOS, so neither does the server, and the log says the two files disagree."""
    with caplog.at_level("WARNING", logger="pdserve.common.tokenizer"):
        tok = Tokenizer.from_model_dir(_write_model_dir(tmp_path, DEEPSEEK_STYLE, bos_processor=False))
    assert tok.encode("hello")[0] != tok.bos_token_id
    assert "add_bos_token true but tokenizer.json's post_processor adds no BOS" in caplog.text


def test_generation_config_eos_ids_are_added(tmp_path):
    tok = Tokenizer.from_model_dir(_write_model_dir(tmp_path, DEEPSEEK_STYLE, {"eos_token_id": [1, 7]}))
    assert tok.eos_token_ids == {1, 7}


def test_unknown_bos_token_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="bos_token"):
        Tokenizer.from_model_dir(_write_model_dir(tmp_path, {**DEEPSEEK_STYLE, "bos_token": "<nope>"}))


def _stream(tok, prompt_ids, output_ids):
    detok = IncrementalDetokenizer(tok, prompt_ids)
    pieces = [detok.push([t]) for t in output_ids]
    return pieces, detok.flush()


@pytest.mark.parametrize("prompt", ["", "Q: say it", "東京 again:"])
@pytest.mark.parametrize("text", TEXTS)
def test_incremental_detokenizer_matches_full_decode(tok, prompt, text):
    prompt_ids = tok.encode(prompt)
    output_ids = tok.encode(text)[1:] + [tok.encode("hello")[-1]]  # output has no bos
    pieces, tail = _stream(tok, prompt_ids, output_ids)
    assert "".join(pieces) + tail == tok.decode(output_ids)
    assert not any(REPLACEMENT_CHAR in p for p in pieces)


def test_multibyte_characters_are_held_back(tok):
    ids = tok.encode("🚀")[1:]
    # The tiny vocabulary must really split the emoji, otherwise this test would check nothing.
    assert len(ids) > 1 and tok.decode(ids[:1]) == REPLACEMENT_CHAR
    pieces, tail = _stream(tok, tok.encode("x"), ids)
    assert pieces == [""] * (len(ids) - 1) + ["🚀"] and tail == ""


def test_flush_releases_an_unfinished_character(tok):
    ids = tok.encode("ab🚀")[1:]
    pieces, tail = _stream(tok, [], ids[:-1])  # the emoji's last byte never arrives
    assert "".join(pieces) == "ab" and tail.startswith(REPLACEMENT_CHAR)
    assert "".join(pieces) + tail == tok.decode(ids[:-1])


def test_prompt_ending_inside_a_character(tok):
    ids = tok.encode("say 東京")[1:]
    cut = len(tok.encode("say 東")[1:]) - 1  # the prompt stops one token before 東 is complete
    pieces, tail = _stream(tok, ids[:cut], ids[cut:])
    assert tok.decode(ids[:cut]).endswith(REPLACEMENT_CHAR)
    assert "".join(pieces) + tail == "東京"


def test_special_tokens_in_output(tok):
    output_ids = tok.encode("hi 東")[1:] + [1]
    pieces, tail = _stream(tok, [], output_ids)
    assert "".join(pieces) + tail == "hi 東"
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
    assert "".join(detok.push([t]) for t in output_ids) + detok.flush() == "hi 東" + EOS


def test_window_stays_small(tok):
    detok = IncrementalDetokenizer(tok, tok.encode("prompt " * 50))
    for t in tok.encode("naïve café 東京 🚀 " * 30)[1:]:
        detok.push([t])
        assert len(detok._ids) <= IncrementalDetokenizer.PREFIX_WINDOW + 8
