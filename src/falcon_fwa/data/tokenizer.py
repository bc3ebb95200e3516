"""Tokenizers: byte-level (default, needs no download), a Hugging Face tokenizer from a
local folder, or a byte-level BPE trained on the corpus with the ``tokenizers`` library.

Every tokenizer is a ``transformers.PreTrainedTokenizerFast`` so that it can be saved next
to a model (``save_pretrained``) and loaded back by ``AutoTokenizer`` (lm-evaluation-harness).
Each has an end-of-text token (``eos_token_id``) that the data pipeline puts at the start of
every document as its separator.
"""
from __future__ import annotations

import difflib
import os
from typing import Iterable, Optional

EOS_TOKEN = "<|endoftext|>"


def _bytes_to_unicode() -> dict:
    """The reversible byte -> printable-character map of byte-level BPE (GPT-2's alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


def _wrap(tok, model_max_length: int = 1 << 30):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS_TOKEN, bos_token=EOS_TOKEN, unk_token=None,
        pad_token=EOS_TOKEN, model_max_length=model_max_length, clean_up_tokenization_spaces=False,
        padding_side="left",  # a batch of prompts for generate() continues each row from its last column
        split_special_tokens=True,  # the text "<|endoftext|>" is text (its bytes), as in the shards
    )


def byte_tokenizer():
    """Byte-level tokenizer: token id == UTF-8 byte value (0..255), end-of-text = 256.

    Built as a merge-free byte-level BPE so it round-trips through ``save_pretrained``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    b2u = _bytes_to_unicode()
    vocab = {b2u[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS_TOKEN])
    return _wrap(tok)


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int):
    """Train a byte-level BPE of ``vocab_size`` tokens (end-of-text included) on ``texts``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size <= 257:
        raise ValueError(f"tokenizer vocab_size must exceed 257 for BPE, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return _wrap(tok)


def bpe_vocab_size(spec: str) -> int:
    """The vocabulary size ``N`` of a ``"bpe:N"`` tokenizer spec; ``ValueError`` (its message
    reads after the name of the setting) unless ``N`` is an integer > 257."""
    size = spec.split(":", 1)[1].strip()
    if not size.isdecimal():  # (isdigit takes superscripts, which int() refuses)
        raise ValueError(f"bpe:N needs an integer N (the vocabulary size), got {spec!r}")
    if int(size) <= 257:
        raise ValueError(f"bpe:N needs N > 257 (the 256 bytes and the end-of-text token come first), got {spec!r}")
    return int(size)


def canonical_spec(spec: str) -> str:
    """``spec`` as a preparation records it: a valid ``"bpe:N"`` spelt ``bpe:<N in ASCII digits>`` (``"bpe: 0300"``
    and ``"bpe:\u0663\u0660\u0660"`` are ``"bpe:300"``, the one tokenizer they train); a local folder's absolute
    path (``"./tok/"`` run from ``/work`` is ``"/work/tok"``, as ``os.path.abspath`` writes it): the folder it names
    from the working folder now, which a command run later from another folder finds by the same name; any other
    spec as given (``byte``, which names the byte tokenizer even beside a folder of that name, as
    :func:`load_tokenizer` reads it; a Hub name, a folder that does not exist; a bad ``bpe:N`` is left for
    :func:`bpe_vocab_size` to name)."""
    if not spec.startswith("bpe:"):
        return os.path.abspath(spec) if spec and spec != "byte" and os.path.isdir(spec) else spec
    try:
        return f"bpe:{bpe_vocab_size(spec)}"
    except ValueError:
        return spec


def same_spec(recorded: str, spec: str) -> bool:
    """Whether the tokenizer setting ``recorded`` that a preparation kept names the tokenizer ``spec`` names now: the
    same as :func:`canonical_spec` writes both, or a local folder kept by its absolute path and gone since, which
    ``spec`` names from the working folder (``tok``, ``./tok/``: a folder deleted whole is the setting it was, its
    copy saved with the shards). ``byte`` and ``bpe:N`` name no folder."""
    if canonical_spec(recorded) == canonical_spec(spec):
        return True
    return (os.path.isabs(recorded) and not os.path.exists(recorded) and spec not in ("", "byte")
            and not spec.startswith("bpe:") and os.path.abspath(spec) == os.path.abspath(recorded))


def is_missing_folder(spec: str) -> bool:
    """Whether a tokenizer ``spec`` names a local folder by its form (absolute, ``./`` or ``../``, a trailing ``/``,
    or more than the one ``/`` of a Hub name ``OWNER/NAME``) that does not exist."""
    return not os.path.exists(spec) and (os.path.isabs(spec) or spec.startswith(("./", "../")) or spec.count("/") > 1
                                         or spec.endswith("/"))


# The files of a folder that loading a tokenizer from it reads (AutoTokenizer.from_pretrained, as load_tokenizer calls
# it): the files every tokenizer class looks for, and the vocabulary files (vocab_files_names) of the transformers
# tokenizer classes that no pattern below covers.
TOKENIZER_FILE_NAMES = frozenset({
    "special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "chat_template.json",
    "merges.txt", "tekken.json", "bpe.codes", "dict.txt", "entity_vocab.json", "emoji.json", "normalizer.json",
    "byte_maps.json", "word_shape.json", "word_pronunciation.json", "target_vocab.json", "prophetnet.tokenizer",
})
CHAT_TEMPLATE_DIR = "additional_chat_templates"  # (of a folder: its *.jinja files are the tokenizer's named templates)


def is_tokenizer_file(name: str) -> bool:
    """Whether the file ``name`` (its path inside a tokenizer folder) is one that :func:`load_tokenizer` reads, or may
    read, from the folder (``transformers.AutoTokenizer.from_pretrained`` on a local folder looks for these by name):

    - ``tokenizer*``: ``tokenizer.json``, ``tokenizer_config.json``, a versioned ``tokenizer.<version>.json``
      (``fast_tokenizer_files``), ``tokenizer.model`` (sentencepiece, tiktoken), ``tokenizer.model.v3``;
    - ``special_tokens_map.json``, ``added_tokens.json``;
    - chat templates: ``chat_template.jinja``, ``chat_template.json``, ``additional_chat_templates/*.jinja``;
    - vocabularies: ``vocab*`` (``vocab.json``, ``vocab.txt``, ``vocab-src.json``), ``merges.txt``, ``*.model``
      (sentencepiece: ``spiece.model``, ``sentencepiece.bpe.model``, ``spm.model``; ``tiktoken.model``),
      ``*.tiktoken``, ``tekken.json``, and the rarer files of single classes (``bpe.codes``, ``dict.txt``,
      ``entity_vocab.json``, ``emoji.json`` ...: :data:`TOKENIZER_FILE_NAMES`).

    A model's files beside them are none: ``model.safetensors``, ``generation_config.json``, a README, and
    ``config.json``, which ``AutoTokenizer`` reads for the model type (that picks the class to load where
    ``tokenizer_config.json`` names no ``tokenizer_class``, as ``save_pretrained`` does, and for a few model types
    over the one named) and which each save of a model into the folder rewrites. Other folders' files are none."""
    parent, base = os.path.split(os.path.normpath(name))
    if parent:
        return parent == CHAT_TEMPLATE_DIR and base.endswith(".jinja")
    return (base in TOKENIZER_FILE_NAMES or base.startswith(("tokenizer", "vocab"))
            or base.endswith((".model", ".tiktoken")))


def load_tokenizer(spec: str, *, texts: Optional[Iterable[str]] = None, name: str = "tokenizer"):
    """``spec``: ``"byte"``, ``"bpe:<vocab_size>"`` (trained on ``texts``), a local folder
    holding a Hugging Face tokenizer, or a Hub tokenizer name (online, or from the Hugging Face cache).
    ``name``: what errors call the setting (a command's ``--tokenizer``, a recipe's ``data.tokenizer``)."""
    if spec == "byte":
        return byte_tokenizer()
    if spec.startswith("bpe:"):
        if texts is None:
            raise ValueError(f"{name} 'bpe:N' needs the corpus texts to train on")
        try:
            size = bpe_vocab_size(spec)
        except ValueError as err:
            raise ValueError(f"{name} {err}") from None
        return train_bpe_tokenizer(texts, size)
    if not os.path.isdir(spec) and "/" not in spec:  # a misspelt built-in would otherwise go to the Hub
        meant = ("byte" if difflib.get_close_matches(spec.lower(), ["byte"], 1, 0.75)
                 else "bpe:<vocab_size>" if spec.lower().startswith("bpe") else None)
        if meant is not None:
            raise ValueError(f"{name} {spec!r} is no tokenizer (did you mean {meant!r}?)")
    if is_missing_folder(spec):
        raise ValueError(f"{name} folder {spec!r} does not exist (a Hub name is NAME or OWNER/NAME)")
    if os.path.isfile(spec):
        raise ValueError(f"{name} {spec!r} is a file: give the folder that holds it (tokenizer.json and a "
                         "tokenizer_config.json naming its \"eos_token\")")
    from transformers import AutoTokenizer

    try:  # a local folder, or a Hugging Face Hub name when online
        tok = AutoTokenizer.from_pretrained(spec, local_files_only=os.path.isdir(spec), trust_remote_code=False)
    except (OSError, ValueError) as err:
        tok = _tokenizer_json_folder(spec)
        if tok is not None:
            return _checked(tok, spec, name)
        cache_only = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
        hint = ("" if os.path.isdir(spec) or cache_only else " (a Hub name is read from the network, or from the "
                "Hugging Face cache alone, without the network's retries, where HF_HUB_OFFLINE=1 is set)")
        raise ValueError(f"{name} must be 'byte', 'bpe:<vocab_size>', a local tokenizer folder or a Hub "
                         f"name{hint}; loading {spec!r} failed: {err}") from None
    return _checked(tok, spec, name)


def _tokenizer_json_folder(spec: str):
    """A folder of ``tokenizer.json`` whose ``tokenizer_config.json`` names no ``tokenizer_class``, loaded as the
    fast tokenizer it describes, or None for any other folder or name. transformers 5's ``AutoTokenizer`` loads
    such a folder itself; transformers 4 looks for the class in a ``config.json`` and refuses it without one. Its
    ``PreTrainedTokenizerFast`` would also set the pre-tokenizer's ``add_prefix_space`` to its own default (False):
    the file's value is passed on unless the config names one."""
    import json

    def read(file: str) -> dict:
        with open(os.path.join(spec, file), encoding="utf-8") as f:
            held = json.load(f)
        if not isinstance(held, dict):
            raise ValueError(f"{file} holds no JSON object")
        return held

    if not (os.path.isdir(spec) and os.path.isfile(os.path.join(spec, "tokenizer.json"))):
        return None
    try:
        config = read("tokenizer_config.json")
    except FileNotFoundError:  # then the end-of-text check names the missing file
        config = {}
    except (OSError, ValueError):
        return None
    if config.get("tokenizer_class") not in (None, "PreTrainedTokenizerFast"):
        return None
    from transformers import PreTrainedTokenizerFast

    try:
        pre = read("tokenizer.json").get("pre_tokenizer")
        kwargs = ({"add_prefix_space": pre["add_prefix_space"]}
                  if isinstance(pre, dict) and "add_prefix_space" in pre and "add_prefix_space" not in config else {})
        return PreTrainedTokenizerFast.from_pretrained(spec, local_files_only=True, **kwargs)
    except Exception:  # noqa: BLE001 - an unreadable tokenizer.json: the caller reports AutoTokenizer's error
        return None


def _checked(tok, spec: str, name: str):
    """``tok`` loaded from ``spec``, if it has an end-of-text token and ids ``0..len(tok) - 1``."""
    if tok.eos_token_id is None:
        raise ValueError(f"{name} {spec!r} defines no eos_token (a folder holding only tokenizer.json needs a "
                         "tokenizer_config.json naming its \"eos_token\")")
    top = max(tok.get_vocab().values(), default=-1)
    if top >= len(tok):  # shards, model and perplexity size the vocabulary by len(tokenizer)
        raise ValueError(f"{name} {spec!r} has ids up to {top} but {len(tok)} tokens: its ids must be 0..N-1")
    return tok


def is_byte_tokenizer(tokenizer) -> bool:
    """True when ``tokenizer`` maps text to its UTF-8 bytes with end-of-text 256 (the byte tokenizer)."""
    probe = "\x00a \u00e9\n\u20ac~\x7f"
    return (len(tokenizer) == 257 and tokenizer.eos_token_id == 256
            and tokenizer(probe, add_special_tokens=False)["input_ids"] == list(probe.encode("utf-8")))


def encode_documents(tokenizer, texts: list, *, byte_level: Optional[bool] = None) -> list:
    """Token ids (numpy int64 arrays) of each text, without special tokens: a document's text is text,
    so a special token's name written in it (``"<|endoftext|>"``) is tokenized as text, not as that token.

    The byte tokenizer takes a direct path (UTF-8 bytes), identical to its slow path.
    """
    import numpy as np

    if not texts:
        return []
    if byte_level is None:
        byte_level = is_byte_tokenizer(tokenizer)
    if byte_level:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.int64) for t in texts]
    ids = tokenizer(texts, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    return [np.asarray(i, dtype=np.int64) for i in ids]
