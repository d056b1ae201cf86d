"""A tokenizer folder made from a vocabulary and a chat template file, for a model whose current template
(or tokenizer folder) is not at hand: ``packprep tokenizer make``.

The vocabulary (a folder holding ``tokenizer.json``, or a Hub id whose ``tokenizer.json`` is fetched) keeps
its model, pre-tokenizer, normalizer and added tokens; the family's special tokens (BOS, EOS, pad, the
control strings its template writes) are added where the vocabulary has no added token for them, at the
next free ids, as the model's own tokenizer adds them; ``tokenizer_config.json`` gets them and the
template. The folder is what ``tokenizer.save_pretrained`` writes, and transformers and packprep read it
alike (``tokenizer_class`` PreTrainedTokenizerFast unless the vocabulary's config names another).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .errors import ConfigError

TOKEN_FIELDS = ("content", "lstrip", "normalized", "rstrip", "single_word", "special")
ROLES = ("bos_token", "eos_token", "pad_token", "unk_token")


def added_token(id: int, content: str, special: bool = True, rstrip: bool = False) -> dict:
    """One ``added_tokens`` entry of a tokenizer.json."""
    return {"id": id, "content": content, "single_word": False, "lstrip": False, "rstrip": rstrip,
            "normalized": False, "special": special}


def add_tokens(tokenizer: dict, tokens: list[tuple[str, bool]]) -> list[dict]:
    """Add each ``(content, special)`` of ``tokens`` to ``tokenizer``'s added tokens, unless one is there:
    at its id where the vocabulary holds it as one piece, else at the next free id. Returns the list."""
    vocab = tokenizer["model"].get("vocab") or {}
    added = tokenizer.setdefault("added_tokens", [])
    have = {t["content"] for t in added}
    next_id = max([-1, *(vocab.values() if isinstance(vocab, dict) else range(len(vocab))),
                   *(t["id"] for t in added)]) + 1
    for content, special in tokens:
        if content in have:
            continue
        piece = vocab.get(content) if isinstance(vocab, dict) else None
        added.append(added_token(next_id if piece is None else piece, content, special))
        have.add(content)
        next_id += piece is None
    added.sort(key=lambda t: t["id"])
    return added


def write_folder(dest: str | os.PathLike, tokenizer: dict, config: dict, template: str,
                 licences_from: str | os.PathLike | None = None) -> Path:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` (``config`` with the added tokens' decoder
    and ``template``) into ``dest``, with the vocabulary's LICENSE and NOTICE where it has them."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    config = {**config, "added_tokens_decoder": {str(t["id"]): {k: t[k] for k in TOKEN_FIELDS}
                                                 for t in tokenizer.get("added_tokens", [])},
              "chat_template": template}
    (dest / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False), encoding="utf-8")
    (dest / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=1), encoding="utf-8")
    for licence in ("LICENSE", "NOTICE"):
        if licences_from is not None and (Path(licences_from) / licence).is_file():
            (dest / licence).write_bytes((Path(licences_from) / licence).read_bytes())
    return dest


def vocabulary_folder(vocab: str | os.PathLike) -> Path:
    """The folder holding the vocabulary's tokenizer.json: ``vocab`` itself, or the Hub's files of the
    model ``vocab`` in the Hugging Face cache."""
    from .read import looks_like_hub_id

    path = Path(vocab)
    if path.is_dir():
        if not (path / "tokenizer.json").is_file():
            raise ConfigError(f"--vocab {vocab}: no tokenizer.json in this folder (a fast tokenizer's folder, as "
                              "tokenizer.save_pretrained writes it)")
        return path
    if path.exists() or not looks_like_hub_id(str(vocab)):
        raise ConfigError(f"--vocab {vocab}: no such folder, and not a Hub model id")
    from huggingface_hub import hf_hub_download

    try:
        file = hf_hub_download(str(vocab), "tokenizer.json")
        try:
            hf_hub_download(str(vocab), "tokenizer_config.json")
        except Exception:  # a vocabulary without a config is still one
            pass
    except Exception as exc:
        raise ConfigError(f"--vocab {vocab}: cannot fetch its tokenizer.json from the Hub ({exc})") from None
    return Path(file).parent


def make_tokenizer_folder(vocab: str | os.PathLike, template: str | os.PathLike, output: str | os.PathLike, *,
                          eos: str, bos: str | None = None, pad: str | None = None, unk: str | None = None,
                          special_tokens: tuple[str, ...] = (), added_tokens: tuple[str, ...] = (),
                          overwrite: bool = False) -> Path:
    """Write at ``output`` a tokenizer folder of the vocabulary ``vocab`` with the chat template file
    ``template``: ``eos`` (and ``bos``, ``pad``, ``unk``) and ``special_tokens`` as special tokens,
    ``added_tokens`` as added tokens that are not special (tags such as Qwen3's ``<think>``, which decode
    as text). Every string is one token of the folder, and the folder loads with transformers."""
    from .tokenizer_folder import compile_template
    from .write import OutputFolder

    template_path = Path(template)
    if not template_path.is_file():
        raise ConfigError(f"--template {template}: no such file (a Jinja chat template, such as the model's "
                          "chat_template.jinja)")
    text = template_path.read_text(encoding="utf-8")
    try:
        compile_template(text)
    except Exception as exc:
        raise ConfigError(f"--template {template}: not a Jinja template that compiles ({exc})") from None
    source = vocabulary_folder(vocab)
    tokenizer = json.loads((source / "tokenizer.json").read_text(encoding="utf-8"))
    config_path = source / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
    config.pop("chat_template", None)
    config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    config.setdefault("clean_up_tokenization_spaces", False)
    roles = dict(zip(ROLES, (bos, eos, pad, unk)))
    config.update({role: value for role, value in roles.items() if value is not None})
    specials = [value for value in roles.values() if value] + list(special_tokens)
    add_tokens(tokenizer, [(t, True) for t in specials] + [(t, False) for t in added_tokens])
    folder = OutputFolder(output, overwrite)
    with folder.staging() as staging:
        write_folder(staging, tokenizer, config, text, source)
        folder.commit()
    return Path(output)
