"""Load a tokenizer folder with ``tokenizers`` and ``jinja2`` alone, without importing transformers.

``AutoTokenizer.from_pretrained`` imports transformers, and on a machine with torch installed that
pulls torch in: 5-7 s before the first record is read, for every command. A folder whose
``tokenizer_class`` keeps all of its behaviour in ``tokenizer.json`` (the classes in
``SAME_AS_TOKENIZER_JSON``) is fully described by that file, its ``tokenizer_config.json`` (chat
template, special tokens) and an optional ``chat_template.jinja``; this module reads exactly those.
Any other folder, or a Hub id, is loaded by transformers as before (``tokenize.load_tokenizer``).

The chat template is compiled in a copy of transformers' sandboxed environment
(``compile_template``). tests/test_tokenizer_folder.py holds both halves to transformers itself:
the same ids for every fixture tokenizer and text, and the same rendering for every fixture
conversation and template; ``packprep verify --retokenize`` re-checks a packed output with
transformers' own tokenizer.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import threading
from itertools import islice
from pathlib import Path

from .errors import ConfigError, Rejected
from .json_limits import loads
from .template_inputs import DEFAULT_DATE, FixedClock, check_date, named_templates

# Classes that, in transformers 4.45+ and 5.x, load tokenizer.json as it is and add nothing of their
# own to encoding (held to transformers by tests for every fixture). A class outside this list (e.g.
# LlamaTokenizer, which transformers 5 rebuilds as a non-legacy pipeline) goes to transformers.
SAME_AS_TOKENIZER_JSON = frozenset(
    {"PreTrainedTokenizerFast", "TokenizersBackend", "Qwen2Tokenizer", "Qwen2TokenizerFast", "GPT2Tokenizer",
     "GPT2TokenizerFast"}
)
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


def loadable(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a folder this module loads exactly as transformers would."""
    folder = Path(path)
    if not (folder / "tokenizer.json").is_file() or not (folder / "tokenizer_config.json").is_file():
        return False
    try:  # a config nested too deep to read here (json_limits): transformers' loader says what is wrong
        config = loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"), "tokenizer_config.json")
    except (OSError, ValueError):
        return False
    return config.get("tokenizer_class") in SAME_AS_TOKENIZER_JSON and _specials_added(folder, config)


def _specials_added(folder: Path, config: dict) -> bool:
    """Whether every special token the config names is an added token of tokenizer.json: transformers
    adds one that is not (a ``<s>`` that is only a piece of the vocabulary), and then splits it out of
    a text where tokenizer.json alone would not."""
    named = {_content(config.get(name)) for name in SPECIAL_TOKENS}
    named |= {_content(t) for t in config.get("additional_special_tokens") or []}
    named.discard(None)
    if not named:
        return True
    try:
        added = _added_in_file(folder)
    except (ValueError, RecursionError):
        return False
    return named <= {t.get("content") for t in added if isinstance(t, dict)}


def _added_in_file(folder: Path) -> list:
    """tokenizer.json's added_tokens array, read alone, not the vocabulary around it (9 MB for llama3)."""
    data = (folder / "tokenizer.json").read_text(encoding="utf-8")
    at = data.find("[", data.find('"added_tokens"'))
    return json.JSONDecoder().raw_decode(data, at)[0] if at > 0 else []


def added_tokens(tokenizer) -> list[dict]:
    """Every added token of a tokenizer as tokenizer.json writes it ({"content", "id", "special",
    "lstrip", "rstrip", "normalized", "single_word"}): from the file while a folder's
    ``tokenizers.Tokenizer`` is not built, else from that tokenizer (transformers may add some)."""
    folder = getattr(tokenizer, "name_or_path", None)
    if not getattr(tokenizer, "backend_loaded", True) and folder and (Path(folder) / "tokenizer.json").is_file():
        return _added_in_file(Path(folder))
    hf = getattr(tokenizer, "backend_tokenizer", tokenizer)
    return [{"content": t.content, "id": i, "special": t.special, "lstrip": t.lstrip, "rstrip": t.rstrip,
             "normalized": t.normalized, "single_word": t.single_word}
            for i, t in hf.get_added_tokens_decoder().items()]


class FolderTokenizer:
    """The parts of a transformers fast tokenizer that packprep uses, read from the folder's files.

    The ``tokenizers.Tokenizer`` (``backend_tokenizer``) is built on first use: parsing a large
    tokenizer.json takes 0.3-0.5 s (llama3's 9 MB) and holds the GIL, and a run whose tiktoken
    conversion is cached never needs it (tiktoken_backend.TiktokenBackend.from_verified). What that
    cache knows about tokenizer.json (the vocabulary size, the ids of the added and special tokens)
    is put in ``known`` by the cache's reader, and answers ``len()`` and ``*_token_id`` without it.
    """

    backend_loads = 0  # how many ``tokenizers.Tokenizer`` this process built for any folder (tests count them)

    def __init__(self, path: str | os.PathLike):
        folder = Path(path)
        self.name_or_path = str(path)
        self._sha256: str | None = None
        self._hashing: threading.Thread | None = None
        self._backend = None
        self.known: dict = {}  # "vocab_size", "token_ids" ({content: id}): facts of this tokenizer.json
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
        mapped = folder / "special_tokens_map.json"
        special = json.loads(mapped.read_text(encoding="utf-8")) if mapped.is_file() else {}
        special.update({name: config[name] for name in SPECIAL_TOKENS if name in config})
        self.special_tokens_map = {
            name: _content(special[name]) for name in SPECIAL_TOKENS if _content(special.get(name)) is not None
        }
        template_file = folder / "chat_template.jinja"
        self.chat_template = (  # several named templates: {name: template}, as transformers holds them
            template_file.read_text(encoding="utf-8") if template_file.is_file()
            else named_templates(config.get("chat_template") or _processor_template(folder), f"tokenizer {folder}")
        )

    @property
    def backend_tokenizer(self):
        """The ``tokenizers.Tokenizer`` of tokenizer.json, built on first use."""
        if self._backend is None:
            from tokenizers import Tokenizer

            data = (Path(self.name_or_path) / "tokenizer.json").read_bytes()
            if self._sha256 is not None or self._hashing is not None:
                if hashlib.sha256(data).hexdigest() != self.file_sha256:  # what the cached facts describe
                    raise ConfigError(f"{self.name_or_path}/tokenizer.json changed while packprep was using it")
            try:
                self._backend = Tokenizer.from_buffer(data)
            except Exception as exc:  # the library's own error for a file it cannot read: broken, or nested too deep
                raise ConfigError(f"tokenizer {self.name_or_path!r}: its tokenizer.json cannot be read ({exc}); "
                                  "pass a folder whose tokenizer.json the tokenizers library reads") from None
            FolderTokenizer.backend_loads += 1
        return self._backend

    @property
    def backend_loaded(self) -> bool:
        return self._backend is not None

    def hash_in_background(self) -> None:
        """Start computing ``file_sha256`` on a thread (hashlib lets go of the GIL while it hashes)."""
        if self._sha256 is None and self._hashing is None:
            self._hashing = threading.Thread(target=self._hash, daemon=True)
            self._hashing.start()

    def _hash(self) -> None:
        self._sha256 = hashlib.sha256((Path(self.name_or_path) / "tokenizer.json").read_bytes()).hexdigest()

    @property
    def file_sha256(self) -> str:
        """The tokenizer.json's sha256: the key under which derived data (tiktoken ranks) is cached."""
        if self._hashing is not None:
            self._hashing.join()
            self._hashing = None
        if self._sha256 is None:
            self._hash()
        return self._sha256

    def __getattr__(self, name: str):
        if name in SPECIAL_TOKENS:
            return self.special_tokens_map.get(name)
        if name.endswith("_token_id") and name[: -len("_id")] in SPECIAL_TOKENS:
            token = self.special_tokens_map.get(name[: -len("_id")])
            if token is None:
                return None
            known = self.known.get("token_ids", {})
            return known[token] if token in known else self.backend_tokenizer.token_to_id(token)
        raise AttributeError(name)

    def __len__(self) -> int:
        if "vocab_size" in self.known:
            return self.known["vocab_size"]
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.backend_tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


def _content(value):
    """A special token as tokenizer_config.json stores it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value


RENDERED_CHARS = 1 << 26  # characters one rendering may write (67M, 6x --max-record-chars: GBs of memory past it)


class RenderTooLong(Exception):
    """A rendering past :data:`RENDERED_CHARS`. Not a :class:`Rejected`: where a rendering is refused
    (a prefix, a probe of the history), render.py takes a turn as not located, but this is the record's
    own size, whichever rendering meets it; it passes through to the encoder, which rejects the record
    (:meth:`rejected`), or, at a start-up probe, stops the run."""

    def __init__(self):
        super().__init__(f"the chat template renders more than {RENDERED_CHARS:,} characters")

    def rejected(self) -> Rejected:
        return Rejected(f"{self} for this record; it is rejected (rendering on would take GBs of memory)",
                        "render_too_long")


def _raise_exception(message):
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


# What a template may build, besides what it writes: a string, list or number past RENDERED_CHARS (characters,
# items, bytes) is refused before it is made, by whichever operation would make it: ``+ * % **``, ``~``, the
# filters and string methods that grow a string by an argument (``center(10**10)``, ``replace``, a format's
# width). What the others make is no larger than what they are given.
_WIDTH = re.compile(r"%(?:\([^)]*\))?[-#0 +]*([0-9]*)(?:\.([0-9]+))?")  # a %-format's width and precision
_SPEC = re.compile(r"\{[^{}]*:([^{}]*)\}")  # a str.format field's format spec
GROWING = frozenset({"center", "ljust", "rjust", "zfill", "expandtabs", "replace", "join", "format", "format_map",
                     "indent", "wordwrap", "tojson", "pprint"})  # filters and str methods whose result may outgrow
_SIZED = (str, list, tuple)


def _size_after(operator: str, left, right) -> int:
    """How large ``left <operator> right`` would be (0 where it makes no string, list or integer)."""
    if operator == "+":
        return len(left) + len(right) if isinstance(left, _SIZED) and isinstance(right, _SIZED) else 0
    if operator == "*":
        sized = left if isinstance(left, _SIZED) else right if isinstance(right, _SIZED) else None
        times = right if sized is left else left
        return len(sized) * times if sized is not None and isinstance(times, int) else 0
    if operator == "%" and isinstance(left, str):
        numbers = [int(n) for match in _WIDTH.findall(left) for n in match if n]
        given = [v for v in (right if isinstance(right, tuple) else (right,)) if isinstance(v, int)]
        return len(left) + sum(numbers) + max([0, *given]) * ("*" in left)
    if operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
        return abs(left).bit_length() * right // 8  # the power's bytes
    return 0


def _grown(name: str, subject, args: tuple) -> int:
    """How large ``replace``, ``indent`` or ``format`` (a method of ``subject``, or a filter) would make a
    string; 0 for any other."""
    texts = [a for a in ((subject,) if isinstance(subject, str) else ()) + args if isinstance(a, str)]
    if name == "replace" and len(texts) >= 3:
        text, old, new = texts[-3:]
        return len(text) + (text.count(old) if old else len(text) + 1) * max(0, len(new) - len(old))
    if name == "indent" and texts:
        width = next((a for a in args if type(a) is int), 4)
        return len(texts[0]) * (1 + len(width) if isinstance(width, str) else 1) + width * texts[0].count("\n")
    if name in ("format", "format_map") and isinstance(subject, str):
        return len(subject) + sum(int(n) for spec in _SPEC.findall(subject) for n in re.findall("[0-9]+", spec))
    if name == "format" and texts:  # the filter: value % args
        return _size_after("%", texts[0], tuple(args[1:]))
    return 0


def bounded_call(name: str, subject, function, *args, **kwargs):
    """``function(*args, **kwargs)``, a filter or a str method (``name``, of ``subject``) that may grow a
    string: refused for an integer argument past RENDERED_CHARS or a string it would grow past it before it
    runs, and for a result past it after."""
    if (any(type(v) is int and v > RENDERED_CHARS for v in (*args, *kwargs.values()))
            or _grown(name, subject, args) > RENDERED_CHARS):
        raise RenderTooLong()
    result = function(*args, **kwargs)
    if isinstance(result, _SIZED) and len(result) > RENDERED_CHARS:
        raise RenderTooLong()
    return result


def _bounded_filter(name: str, function):
    """The filter ``function``, called through :func:`bounded_call` (Jinja's pass_context marks kept)."""
    return functools.wraps(function)(functools.partial(bounded_call, name, None, function))


def compile_template(template: str):
    """Compile ``template`` in a sandboxed environment set up as transformers sets up its own.

    Mirrors ``transformers.utils.chat_template_utils._compile_jinja_template`` (trim_blocks,
    lstrip_blocks, loop controls, the ``generation`` tag, ``tojson`` without HTML escaping,
    ``raise_exception``, ``strftime_now`` (of a fixed date, not the clock), a restricted ``dict`` and ``namespace``).
    """
    from jinja2.ext import loopcontrols

    Generation, TemplateDict, TemplateNamespace = _template_types()
    environment = _environment_type()(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    environment.filters["tojson"] = _tojson
    environment.filters.update({name: _bounded_filter(name, environment.filters[name])
                                for name in GROWING & set(environment.filters)})
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = FixedClock(check_date(DEFAULT_DATE))  # never the clock: template_inputs.py
    environment.globals["dict"] = TemplateDict()
    environment.globals["namespace"] = TemplateNamespace
    return environment.from_string(template)


@functools.lru_cache(maxsize=1)
def _template_types():
    """The ``generation`` tag, ``dict`` and ``namespace`` as transformers gives them to a template (made on
    first use: ``import packprep`` does not import jinja2)."""
    import jinja2
    from jinja2.ext import Extension

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}`` renders its body (transformers tracks it; we need not)."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class TemplateDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"chat templates cannot set {name!r} on a namespace")
    return Generation, TemplateDict, TemplateNamespace


@functools.lru_cache(maxsize=1)
def _environment_type():
    """The sandboxed environment, bounded in what a template writes and builds (made on first use)."""
    from jinja2.compiler import CodeGenerator
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generator(CodeGenerator):
        def visit_Concat(self, node, frame):  # ``a ~ b``: joined by the environment, which bounds it
            self.write("environment.joined((")
            for argument in node.nodes:
                self.visit(argument, frame)
                self.write(", ")
            self.write("))")

    class Environment(ImmutableSandboxedEnvironment):
        """Its output, and every string, list or number a template builds, stop at :data:`RENDERED_CHARS`:
        a small record must not render gigabytes (``{{ 'x' * 10**10 }}``, loops that write on and on)
        nor build them unwritten (a string doubled in a ``namespace``, ``'x' | center(10**10)``)."""

        intercepted_binops = frozenset({"*", "+", "%", "**"})
        code_generator_class = Generator

        def call_binop(self, context, operator, left, right):
            if operator == "+" and type(left) is str and type(right) is str:  # most of them: at once
                if len(left) + len(right) > RENDERED_CHARS:
                    raise RenderTooLong()
                return left + right
            if _size_after(operator, left, right) > RENDERED_CHARS:
                raise RenderTooLong()
            return super().call_binop(context, operator, left, right)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (Jinja's own signature)
            name = getattr(getattr(__obj, "__wrapped__", __obj), "__name__", None)  # the sandbox wraps str.format
            if name in GROWING:
                subject = getattr(getattr(__obj, "__wrapped__", __obj), "__self__", None)
                return bounded_call(name, subject, super().call, __context, __obj, *args, **kwargs)
            return super().call(__context, __obj, *args, **kwargs)

        call.bounded = True  # faster_sandbox may call plain methods directly: it bounds them alike

        def concat(self, chunks):  # Template.render's "".join, a batch at a time: as fast, and bounded
            parts, size, chunks = [], 0, iter(chunks)
            while batch := list(islice(chunks, 4096)):
                parts.append("".join(batch))
                size += len(parts[-1])
                if size > RENDERED_CHARS:
                    raise RenderTooLong()
            return "".join(parts)

        @staticmethod
        def joined(parts) -> str:
            text = "".join(map(str, parts))  # a few parts, each within the limit
            if len(text) > RENDERED_CHARS:
                raise RenderTooLong()
            return text
    return Environment


def faster_sandbox(compiled):
    """``compiled`` (from :func:`compile_template`) with the sandbox's attribute check memoised, its
    ``getattr`` and ``call`` decided once per (type, name) for plain data, and its globals
    snapshotted: the same checks, results and variables, made cheaper (rendering is most of the time
    a template that renders every prefix takes).

    The sandbox asks ``is_safe_attribute(obj, attr, value)`` on every attribute a template reads
    (``loop.index0``, ``content.strip``...), which was half of all rendering time. For Jinja's
    ``ImmutableSandboxedEnvironment`` the answer depends only on ``type(obj)`` and ``attr`` (the
    checks are ``attr.startswith("_")``, ``isinstance`` tests of ``obj`` and a table keyed on
    ``attr``; ``value`` is not read), so it is cached on that key: each check made once per type
    and name, with the same verdict.
    """
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    environment = compiled.environment
    if type(environment).is_safe_attribute is ImmutableSandboxedEnvironment.is_safe_attribute:
        check, verdicts = environment.is_safe_attribute, {}

        def is_safe_attribute(obj, attr, value):
            key = (type(obj), attr)
            if key not in verdicts:
                verdicts[key] = check(obj, attr, value)
            return verdicts[key]

        environment.is_safe_attribute = is_safe_attribute
        if type(environment).getattr is ImmutableSandboxedEnvironment.getattr:
            environment.getattr = _plain_getattr(environment)
        if getattr(type(environment).call, "bounded", False):
            environment.call = _plain_call(environment)
    snapshot_globals(compiled)
    return compiled


# types whose instances have no attributes of their own (no __dict__, no __getattr__): what an attribute of
# one is, is decided by the type and the name alone
_PLAIN = frozenset({str, dict, list, tuple, int, float, bool, type(None)})
_ITEM, _VALUE, _FULL = 0, 1, 2  # how the sandbox's getattr ends for a (type, name)


def _plain_getattr(environment):
    """The sandbox's ``getattr`` (``message.content``, ``content.strip``), with what it decides for the
    plain data types decided once per (type, name); the same result, without an AttributeError raised
    and caught for every key of every message.

    Jinja's ``SandboxedEnvironment.getattr`` tries ``getattr(obj, name)``; where that fails it returns
    ``obj[name]`` (or undefined); else it wraps ``str.format``, and returns the value if
    ``is_safe_attribute`` allows it. For an instance of a :data:`_PLAIN` type, ``getattr`` fails
    exactly when the type has no such attribute, the value is a ``format`` method exactly when the
    type's attribute is one, and ``is_safe_attribute`` depends on the type and the name only (see
    :func:`faster_sandbox`): so those answers are taken once per (type, name), and anything else is
    left to Jinja's own method.
    """
    full, plans = environment.getattr, {}
    undefined = environment.undefined

    def plan(obj, name: str) -> int:
        kind = type(obj)
        if not hasattr(kind, name):
            return _ITEM
        if getattr(getattr(kind, name), "__name__", None) in ("format", "format_map"):
            return _FULL
        return _VALUE if environment.is_safe_attribute(obj, name, getattr(obj, name)) else _FULL

    def plain_getattr(obj, name):
        kind = type(obj)
        if kind not in _PLAIN or not isinstance(name, str):
            return full(obj, name)
        how = plans.get((kind, name))
        if how is None:
            how = plans[kind, name] = plan(obj, name)
        if how == _ITEM:
            try:
                return obj[name]
            except (TypeError, LookupError):
                return undefined(obj=obj, name=name)
        return getattr(obj, name) if how == _VALUE else full(obj, name)

    return plain_getattr


def _plain_call(environment):
    """The sandbox's ``call``, with a method of plain data (``content.strip()``, ``text.split('</think>')``)
    called at once: the same result as Jinja's, without its four attribute look-ups that fail.

    Jinja's ``SandboxedEnvironment.call`` refuses a callable marked ``unsafe_callable`` or
    ``alters_data``, then ``Context.call`` passes the context, eval context or environment to one
    marked ``jinja_pass_arg`` (on it or its ``__call__``), drops ``_block_vars`` and ``_loop_vars``,
    calls it, and turns a StopIteration into undefined. A built-in method bound to an instance of a
    :data:`_PLAIN` type can carry no such mark (it has no ``__dict__``), and it was reached through
    the sandbox's attribute check, so for it that is: drop those two keywords, call (bounded as the
    environment's own call bounds it, for a method that may grow a string), catch.
    """
    import types

    full, builtin = environment.call, types.BuiltinMethodType

    def plain_call(context, obj, *args, **kwargs):
        if type(obj) is not builtin or type(obj.__self__) not in _PLAIN:
            return full(context, obj, *args, **kwargs)
        kwargs.pop("_block_vars", None)
        kwargs.pop("_loop_vars", None)
        try:
            if obj.__name__ in GROWING:
                return bounded_call(obj.__name__, obj.__self__, obj, *args, **kwargs)
            return obj(*args, **kwargs)
        except StopIteration:
            return environment.undefined("value was undefined because a callable raised a StopIteration exception")

    return plain_call


def snapshot_globals(template) -> None:
    """Give a compiled ``template`` its globals as a plain dict instead of Jinja's ``ChainMap`` over the
    environment's: every rendering copies them into its context, and copying the ChainMap cost 5 µs
    of the 20 µs a short conversation took. Nothing adds globals once a template is compiled."""
    template.globals = dict(template.globals)


def _processor_template(folder: Path) -> str | None:
    """The template of a processor folder's ``chat_template.json`` (vision models keep it there), if any."""
    path = folder / "chat_template.json"
    try:
        value = json.loads(path.read_text(encoding="utf-8")).get("chat_template") if path.is_file() else None
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None
