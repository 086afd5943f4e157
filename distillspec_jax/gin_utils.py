"""Gin at the edge: the only library module (with train.py) that imports gin.

* `register_configurables()` registers the library's constructors as external configurables
  (`TrainConfig`, `DistillationConfig`, `model_by_name`, ...), so library modules stay
  gin-free and usable programmatically.
* `parse_gin_flags(argv)` understands T5X-style flags: `--gin_file=F` (repeatable, also
  comma-separated), `--gin.NAME=VALUE` (a binding `NAME = VALUE`; a bare word is quoted as a
  string, so `--gin.MODEL_DIR=/tmp/run` works as well as `--gin.MODEL_DIR="'/tmp/run'"`),
  `--gin_bindings=...` and `--gin_search_paths=...`. Unknown gin files and bad bindings raise
  `GinConfigError` naming the culprit and the fix, before anything is trained.
* `check_bindings_read(argv, binary)`: after a binary builds its configuration, refuses a
  command-line binding it did not read (gin's operative config), which gin would ignore.
* `exit_on_help(argv, binary, doc)`: every binary's --help (its doc, its flags, its run files
  and the macros they set, read from gin/runs and gin/recipes); `run_binary(main, argv)`: the
  binaries' one command-line path (a user's mistake: status 1 and the message, no traceback).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import glob
import os
import re
import sys
from typing import Any, Callable, Optional, Sequence

import gin

from distillspec_jax.models import config as config_lib
from distillspec_jax.data.task_source import TaskSource
from distillspec_jax.distill.objectives import DistillationConfig
from distillspec_jax.models.model import Model
from distillspec_jax.training import multihost
from distillspec_jax.training.trainer import SyntheticData, TrainConfig

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_SEARCH_PATHS = (REPO_ROOT, os.path.join(REPO_ROOT, "gin"))


class GinConfigError(ValueError):
  """A gin file or binding that cannot be used; the message says how to fix it."""


def model_by_name(name: str, **overrides) -> Model:
  """A `Model` from a preset name (`config.MODEL_CONFIGS`) with field overrides.

  gin: `TARGET = @target/model_by_name()` and `target/model_by_name.name = 't5_1_1_xl'`.
  The activation dtype and remat policy are the run's PrecisionConfig's, not a model's.
  """
  fields = {f.name for f in dataclasses.fields(config_lib.TransformerConfig)}
  precision = sorted({"dtype", "remat_policy"} & set(overrides))
  if precision:
    raise GinConfigError(
        f"model_by_name({name!r}): {precision} are set by the run's PrecisionConfig, not per "
        "model: PrecisionConfig.activation_dtype (ACTIVATION_DTYPE), "
        "PrecisionConfig.remat_policy (REMAT_POLICY), and for one model of a distillation "
        "run PrecisionConfig.target_remat_policy / draft_remat_policy.")
  unknown = sorted(set(overrides) - fields)
  if unknown:
    raise GinConfigError(f"model_by_name({name!r}): unknown TransformerConfig field(s) {unknown}; "
                         f"valid fields: {sorted(fields)}.")
  return Model(config_lib.model_config(name, **overrides))


def model_from_checkpoint(path: str) -> Model:
  """A `Model` of the configuration a checkpoint carries (a Hugging Face folder's
  config.json, or the one stored with our checkpoint), so that a user's pretrained model
  needs no preset whose fields must be made to match it.

  gin: `run.target = @target/model_from_checkpoint()` and
  `target/model_from_checkpoint.path = %TARGET_CHECKPOINT_PATH`.
  """
  from distillspec_jax.interop import importer  # opens checkpoints: only where bound
  if not isinstance(path, str) or not path:
    raise GinConfigError(
        f"model_from_checkpoint.path={path!r} is not a checkpoint path: the model is built from "
        "its checkpoint, so give one (gin/runs/distill_own_pair.gin: "
        "--gin.TARGET_CHECKPOINT_PATH=\"'<folder>'\" and --gin.INITIAL_CHECKPOINT_PATH=...).")
  try:
    config = importer.open_checkpoint(path).config
  except ValueError as error:
    raise GinConfigError(f"model_from_checkpoint.path={path!r}: {error}") from None
  if config is None:
    raise GinConfigError(
        f"model_from_checkpoint.path={path!r} does not carry its model's configuration (no "
        "config.json, no stored model config, shapes that do not say everything); name its "
        "preset instead: @model_by_name() with model_by_name.name = '<preset>'.")
  return Model(config)


_REGISTERED: dict = {}


def register(*configurables: Callable, **named: Callable) -> None:
  """The one registration idiom: each class or function as a gin configurable named after
  it (or, as a keyword, under that gin name), once per process. Binaries call it when they
  parse their flags, not at import: run as __main__, a binary's module may also be imported
  under its package name, and gin would see two configurables of one name."""
  for name, fn in [(fn.__name__, fn) for fn in configurables] + list(named.items()):
    if name not in _REGISTERED:
      _REGISTERED[name] = gin.external_configurable(fn, name=name)


def configurable(name: str) -> Callable:
  """The registered configurable `name` (called, it takes its gin bindings)."""
  return _REGISTERED[name]


def register_configurables() -> None:
  """Registers the library constructors every binary's gin files may use."""
  register(model_by_name, model_from_checkpoint, TrainConfig, DistillationConfig,
           SyntheticData, TaskSource, dry_run=dry_run_settings)


def _split(values: Sequence[str]) -> list[str]:
  return [v for value in values for v in value.split(",") if v]


def resolve_gin_file(path: str, search_paths: Sequence[str] = DEFAULT_SEARCH_PATHS) -> str:
  """Absolute path of a gin file (as given, or under a search path), else GinConfigError."""
  candidates = [path] + [os.path.join(root, path) for root in search_paths]
  for candidate in candidates:
    if os.path.isfile(candidate):
      return os.path.abspath(candidate)
  known = sorted(os.path.relpath(p, REPO_ROOT) for p in
                 glob.glob(os.path.join(REPO_ROOT, "gin", "**", "*.gin"), recursive=True))
  close = difflib.get_close_matches(path, known, n=3, cutoff=0.4)
  hint = f" Did you mean {close}?" if close else ""
  raise GinConfigError(f"Unknown gin file {path!r} (looked in the working directory and "
                       f"{list(search_paths)}).{hint} Available files: {known}.")


def _literal(value: str) -> str:
  """A gin value: literals and @references as given; anything else becomes a string."""
  value = value.strip()
  if value.startswith(("@", "%")) or value in ("None", "True", "False"):
    return value
  try:
    ast.literal_eval(value)
    return value
  except (ValueError, SyntaxError):
    return repr(value)


def parse_flags(argv: Sequence[str]) -> tuple[list[str], list[str], list[str], list[str]]:
  """Splits argv into (gin files, gin bindings, search paths, other args)."""
  files, bindings, paths, rest = [], [], [], []
  args = list(argv)
  i = 0
  while i < len(args):
    arg = args[i]
    name, eq, value = arg.partition("=")
    if name in ("--gin_file", "--gin_bindings", "--gin_search_paths") and not eq:
      if i + 1 >= len(args):
        raise GinConfigError(f"{name} needs a value, e.g. {name}=VALUE.")
      value, i = args[i + 1], i + 1
    if name == "--gin_file":
      if not value.strip(" ,"):
        raise GinConfigError(
            f"{arg!r}: --gin_file= names no gin file (an empty value, e.g. an unset shell "
            "variable); pass --gin_file=gin/runs/<run>.gin, or drop the flag.")
      files.extend(_split([value]))
    elif name == "--gin_search_paths":
      paths.extend(_split([value]))
    elif name == "--gin_bindings":
      bindings.append(value)
    elif name.startswith("--gin."):
      if not eq:
        raise GinConfigError(f"{arg!r} has no value; write {arg}=VALUE.")
      bindings.append(f"{name[len('--gin.'):]} = {_literal(value)}")
    else:
      rest.append(arg)
    i += 1
  return files, bindings, paths, rest


def parse_gin(files: Sequence[str], bindings: Sequence[str],
              search_paths: Sequence[str] = ()) -> None:
  """Parses gin files then bindings (later wins), with errors that name the culprit."""
  register_configurables()
  paths = list(search_paths) + list(DEFAULT_SEARCH_PATHS)
  for path in paths:
    gin.add_config_file_search_path(path)
  resolved = [resolve_gin_file(f, paths) for f in files]
  for path in resolved:
    try:
      gin.parse_config_file(path)
    except (ValueError, IOError, SyntaxError) as error:
      raise GinConfigError(f"Cannot parse gin file {path}: {error}\nFix the file, or check its "
                           "`include` lines (paths are relative to the repository root or "
                           "gin/).") from error
  for binding in bindings:
    try:
      gin.parse_config(binding)
    except (ValueError, SyntaxError) as error:
      raise GinConfigError(
          f"Bad gin binding {binding!r}: {error}\nBindings look like --gin.MACRO=VALUE or "
          "--gin.Configurable.parameter=VALUE; strings need quotes when they contain spaces. "
          f"Configurables: {', '.join(sorted(_REGISTERED, key=str.lower))}.") from error
  check_macros()


def check_macros() -> None:
  """Refuses a %MACRO that a binding uses and nothing defines, naming it (before any
  configurable is called, so no other error can hide it)."""
  macro = gin.config.get_configurable(gin.config.macro)
  # gin keeps the parsed bindings in its module's config dict; iterate_references is its own
  # walk over it (the finalize hooks use the same).
  undefined = sorted({reference.scoped_selector.rsplit("/", 1)[0]
                      for reference in gin.config.iterate_references(gin.config._CONFIG,
                                                                     to=macro)
                      if reference.config_key not in gin.config._CONFIG})
  if undefined:
    raise GinConfigError(f"Gin macro(s) {undefined} are used but not defined; pass "
                         f"--gin.{undefined[0]}=VALUE (or define it in a gin file).")


def parse_gin_flags(argv: Sequence[str]) -> list[str]:
  """Parses the gin flags of `argv`; returns the remaining arguments."""
  files, bindings, paths, rest = parse_flags(argv)
  if not files:
    raise GinConfigError("No --gin_file given; pass e.g. --gin_file=gin/runs/distill_tiny.gin.")
  parse_gin(files, bindings, paths)
  return rest


def parse_binary_flags(argv: Sequence[str]) -> None:
  """Parses a binary's gin flags (the multi-host flags already taken out of `argv` by
  multihost.initialize_from_flags); any other argument is an error naming it."""
  rest = parse_flags(argv)[3]
  if rest:  # before parsing: an unknown flag may be what left a macro undefined
    raise GinConfigError(f"Unknown arguments {rest}; use --gin_file=..., --gin.NAME=VALUE, "
                         "--gin_bindings=..., --gin_search_paths=..., and the multi-host flags "
                         "--coordinator_address, --process_count, --process_index")
  parse_gin_flags(argv)


def _command_line_keys(bindings: Sequence[str]) -> list:
  """[(binding text, scope, complete selector, parameter)] of command-line bindings; a
  macro's selector is 'gin.macro' (its name the scope, as gin keys it)."""
  keys = []
  for binding in bindings:
    parser = gin.config_parser.ConfigParser(binding, gin.config.ParserDelegate())
    for statement in parser:
      if not isinstance(statement, gin.config_parser.BindingStatement):
        continue
      scope, selector, arg_name = statement.scope, statement.selector, statement.arg_name
      if not arg_name:
        keys.append((binding, f"{scope}/{selector}" if scope else selector, "gin.macro",
                     "value"))
      else:
        parsed = gin.config.ParsedBindingKey.parse((scope, selector, arg_name))
        keys.append((binding, scope, parsed.complete_selector, arg_name))
  return keys


def _effective_scope(call_scope: str, selector: str, arg_name: str) -> Optional[str]:
  """The scope whose binding of `selector.arg_name` a call in `call_scope` takes: the longest
  prefix of it that binds the parameter (gin's own lookup order), None if none does."""
  parts = call_scope.split("/") if call_scope else []
  found = None
  for i in range(len(parts) + 1):
    prefix = "/".join(parts[:i])
    if arg_name in gin.config._CONFIG.get((prefix, selector), {}):
      found = prefix
  return found


def _read_later(later: Sequence[str]) -> tuple:
  """(selectors, macros) the binary reads after its configuration is built: the `later`
  configurables (e.g. main_job, dry_run) and the macros their bindings refer to."""
  selectors, macros = set(), set()
  macro_fn = gin.config.get_configurable(gin.config.macro)
  pending = []
  for name in later:
    match = gin.config._REGISTRY.get_match(name)  # its complete selector, as _CONFIG keys it
    if match is None:
      continue
    selector = match.selector
    selectors.add(selector)
    pending += [value for (scope, sel), values in gin.config._CONFIG.items()
                if sel == selector for value in values.values()]
  while pending:  # a macro's value may refer to other macros
    value = pending.pop()
    for reference in gin.config.iterate_references(value, to=macro_fn):
      name = reference.scoped_selector.rsplit("/", 1)[0]
      if name not in macros:
        macros.add(name)
        pending += list(gin.config._CONFIG.get((name, "gin.macro"), {}).values())
  return selectors, macros


def unread_bindings(argv: Sequence[str], later: Sequence[str] = ()) -> list:
  """The command-line bindings of `argv` (--gin.NAME=VALUE, --gin_bindings) that the
  configuration built so far did not read: a macro no called configurable's binding referred
  to, a parameter of a configurable never called (in that scope) or overridden there by a
  more specific binding. `later`: configurables the binary calls after this check (their
  bindings and the macros these refer to count as read)."""
  # gin records what each call read in its operative config (the dict behind
  # gin.operative_config_str()); read it after the configuration is built.
  operative = gin.config._OPERATIVE_CONFIG
  later_selectors, later_macros = _read_later(later)
  unread = []
  for binding, scope, selector, arg_name in _command_line_keys(parse_flags(argv)[1]):
    if selector == "gin.macro":
      read = (scope, selector) in operative or scope in later_macros
    else:
      read = selector in later_selectors or any(
          sel == selector and arg_name in params
          and _effective_scope(call_scope, selector, arg_name) == scope
          for (call_scope, sel), params in operative.items())
    if not read:
      unread.append((binding, scope, selector, arg_name))
  return unread


def _files_reading(pattern: str, binary: str, exclude: Sequence[str]) -> str:
  """Where `pattern` is bound: `binary`'s run files (with their includes) whose bindings
  match it, other than `exclude`, then the other binaries' (the first file and a count)."""
  skip = {os.path.abspath(p) for p in exclude}
  parts = []
  for name in sorted(BINARY_MARKERS, key=lambda b: b != binary):
    found = [f for f in binary_gin_files(name)[0]
             if os.path.join(REPO_ROOT, f) not in skip
             and any(re.search(pattern, re.sub(r"#.*", "", text))
                     for _, text in _gin_texts(os.path.join(REPO_ROOT, f)))]
    if found:
      more = f" and {len(found) - 1} more" if len(found) > 1 else ""
      parts.append(f"{name} ({found[0]}{more})")
  return ", ".join(parts) if parts else "no run file"


def check_bindings_read(argv: Sequence[str], binary: str, later: Sequence[str] = ()) -> None:
  """Refuses, before any work, a command-line binding this run does not read (a macro or a
  parameter that the chosen run files never use: it would be silently ignored), naming it,
  the run files and the ones that do read it. Call once the binary's configuration is built;
  `later`: as `unread_bindings`'."""
  unread = unread_bindings(argv, later)
  if not unread:
    return
  files = parse_flags(argv)[0]
  try:
    given = [resolve_gin_file(f) for f in files]
  except GinConfigError:
    given = []
  lines = []
  for binding, scope, selector, arg_name in unread:
    if selector == "gin.macro":
      what = f"nothing it builds refers to %{scope}"
      pattern = rf"%{re.escape(scope)}\b"
    else:
      short = selector.rsplit(".", 1)[-1]
      where = f" in scope {scope!r}" if scope else ""
      what = (f"it never calls {short}{where}, or another binding of {short}.{arg_name} "
              "overrides it there")
      pattern = rf"\b{re.escape(short)}[.(]"
    lines.append(f"  {binding!r}: {what}; read by "
                 f"{_files_reading(pattern, binary, given)}.")
  raise GinConfigError(
      f"{binary} with {', '.join(files)} does not read these command-line bindings (they would "
      "be ignored):\n" + "\n".join(lines) + "\nDrop them, or pick a run file that reads them.")


# The shape fields a gin/models file spells out. Not `dtype` or `remat_policy`: the run's
# PrecisionConfig sets them (model_by_name refuses them).
_MODEL_FIELDS = ("kind", "vocab_size", "emb_dim", "num_heads", "num_encoder_layers",
                 "num_decoder_layers", "head_dim", "mlp_dim", "encoder_mlp_dim", "dropout_rate",
                 "relative_attention_num_buckets", "relative_attention_max_distance",
                 "logits_via_embedding", "max_decode_length")


# The RoPE kinds have no encoder nor relative position bias; they spell out their own fields.
_T5_ONLY_FIELDS = ("num_encoder_layers", "encoder_mlp_dim", "relative_attention_num_buckets",
                   "relative_attention_max_distance")
_LLAMA_MODEL_FIELDS = ("num_kv_heads", "rope_theta", "rope_scaling", "rope_scaling_factor",
                       "rope_low_freq_factor", "rope_high_freq_factor",
                       "rope_original_max_length", "norm_epsilon", "use_qkv_bias")
_GEMMA_MODEL_FIELDS = ("query_pre_attn_scalar", "sliding_window", "sliding_window_pattern",
                       "rope_local_theta", "final_logit_softcapping")


def _model_fields(preset) -> tuple:
  if not preset.is_rope_decoder:
    return _MODEL_FIELDS
  fields = tuple(f for f in _MODEL_FIELDS if f not in _T5_ONLY_FIELDS) + _LLAMA_MODEL_FIELDS
  return fields + (_GEMMA_MODEL_FIELDS if preset.kind == "gemma3" else ())


def model_gin_text(name: str, description: str = "") -> str:
  """The gin/models/<name>.gin text spelling out every field of the preset `name`."""
  preset = config_lib.model_config(name)
  lines = [f"# {description or name}", "#", f"# Use: include 'gin/models/{name}.gin', then e.g.",
           f"#   run.model = @{name}/model_by_name()    (or run.target = ...).",
           "# Every field is spelled out (tests/test_gin_configs.py checks it equals the preset;",
           "# regenerate with `python -m distillspec_jax.gin_utils --write_model_gin`).", "",
           f"{name}/model_by_name.name = '{name}'"]
  lines += [f"{name}/model_by_name.{f} = {getattr(preset, f)!r}" for f in _model_fields(preset)]
  return "\n".join(lines) + "\n"


def write_model_gin_files(directory: str = os.path.join(REPO_ROOT, "gin", "models")) -> None:
  """(Re)writes gin/models/<name>.gin for every preset, keeping each file's first comment."""
  for name in config_lib.MODEL_CONFIGS:
    path = os.path.join(directory, f"{name}.gin")
    description = ""
    if os.path.exists(path):
      first = open(path).readline()
      description = first[2:].strip() if first.startswith("# ") else ""
    with open(path, "w") as f:
      f.write(model_gin_text(name, description))


# --- the binaries' --help and exit status ------------------------------------------------------

# What a gin file binds when it is made for a binary (or is included by one that is).
BINARY_MARKERS = {
    "distillspec_jax.main": ("main_job.", "PipelineConfig.", "GardenConfig.",
                             "RecipeGridConfig."),
    "distillspec_jax.train": ("run.", "TrainConfig.", "DistillationConfig."),
    "distillspec_jax.eval": ("evaluate_job.", "EvalConfig."),
}
HELP_FLAGS = (
    ("--gin_file=FILE", "a gin file (repeatable, or comma-separated), looked up in the working "
     "directory, the repository root and gin/"),
    ("--gin.NAME=VALUE", "one binding: a macro (--gin.MODEL_DIR=/tmp/run) or a parameter "
     "(--gin.Configurable.field=VALUE); a bare word is taken as a string"),
    ("--gin_bindings=BINDING", "a binding in gin syntax, e.g. \"MODEL_DIR = '/tmp/run'\" "
     "(repeatable)"),
    ("--gin_search_paths=DIRS", "more folders (comma-separated) for gin files and their "
     "include lines"),
    ("--coordinator_address=HOST:PORT --process_count=N --process_index=I",
     "multi-host runs (GPU clusters, localhost tests); none on a TPU VM slice"),
    ("--dry_run", "compile every stage's programs on abstract, sharded parameters for the "
     "mesh (DATA_PARALLEL, MODEL_PARALLEL) and the slice (SLICE) in gin, print per-device "
     "bytes, FLOPs and an estimated step time per stage, and exit 1 when one does not fit "
     "(nothing is trained, read or written; simulated CPU devices without an accelerator)"),
    ("--help, -h", "this text (nothing runs)"),
)
USER_ERRORS = (GinConfigError, ValueError, FileNotFoundError, multihost.MultihostError)
_MACRO = re.compile(r"^([A-Z][A-Z0-9_]*)\s*=\s*(.*?)\s*(?:#.*)?$", re.MULTILINE)
_INCLUDE = re.compile(r"^include\s+['\"]([^'\"]+)['\"]", re.MULTILINE)


def _gin_texts(path: str, seen: tuple = ()) -> list:
  """[(path, text)] of a gin file and every file it includes, includes first."""
  if path in seen:
    return []
  text = open(path).read()
  texts = []
  for included in _INCLUDE.findall(text):
    try:
      texts += _gin_texts(resolve_gin_file(included), seen + (path,))
    except GinConfigError:
      continue  # a broken include is the parser's to report, not --help's
  return texts + [(path, text)]


def binary_gin_files(binary: str) -> tuple:
  """(run files, {macro: (value, file)}) of a binary: the gin/runs files made for it and the
  UPPER_CASE macros that they, their includes and the gin/recipes files made for it set (the
  first file's value per macro)."""
  markers = BINARY_MARKERS[binary]
  run_files, macros = [], {}
  for folder in ("runs", "recipes"):
    for path in sorted(glob.glob(os.path.join(REPO_ROOT, "gin", folder, "*.gin"))):
      texts = _gin_texts(path)
      if not any(re.search(rf"^\s*{re.escape(marker)}", text, re.MULTILINE)
                 for _, text in texts for marker in markers):
        continue  # not made for this binary (comments do not count)
      if folder == "runs":
        run_files.append(os.path.relpath(path, REPO_ROOT))
      for source, text in texts:
        for name, value in _MACRO.findall(text):
          macros.setdefault(name, (value, os.path.relpath(source, REPO_ROOT)))
  return run_files, macros


def configs_help(configs: Sequence[type]) -> list:
  """Lines naming each config dataclass a binary's gin files bind and its fields (with the
  defaults)."""
  lines = []
  for config in configs:  # a class, or (its gin name, the class)
    name, config = config if isinstance(config, tuple) else (config.__name__, config)
    fields = [f for f in dataclasses.fields(config) if f.init]
    lines.append(f"  {name}")
    for field in fields:
      if field.default is not dataclasses.MISSING:
        default = repr(field.default)
      elif field.default_factory is not dataclasses.MISSING:
        default = repr(field.default_factory())
      else:
        default = "(required)"
      lines.append(f"      .{field.name} = {default}")
  return lines


def binary_help(binary: str, doc: str, configs: Sequence[type] = ()) -> str:
  """The --help text of a binary: its module doc, its flags, the configs its run files
  bind, its run files and macros."""
  run_files, macros = binary_gin_files(binary)
  lines = [f"usage: python -m {binary} --gin_file=FILE [--gin_file=FILE ...] "
           "[--gin.NAME=VALUE ...]", "", (doc or "").strip(), "", "flags:"]
  lines += [f"  {flag}\n      {text}" for flag, text in HELP_FLAGS]
  if configs:
    lines += ["", "configs the run files bind (--gin.<Config>.<field>=VALUE), with defaults:"]
    lines += configs_help(configs)
  lines += ["", "run files:", "  " + ", ".join(run_files), "",
            "macros the run files set (override any with --gin.NAME=VALUE), with the first "
            "value found:"]
  width = max((len(name) for name in macros), default=0)
  lines += [f"  {name:<{width}}  {value}   ({source})"
            for name, (value, source) in sorted(macros.items())]
  return "\n".join(lines) + "\n"


def exit_on_help(argv: Sequence[str], binary: str, doc: str,
                 configs: Sequence[type] = ()) -> None:
  """Prints the binary's help and exits 0 when argv asks for it (--help, -h)."""
  if any(arg in ("--help", "-h", "--helpfull") for arg in argv):
    print(binary_help(binary, doc, configs))
    raise SystemExit(0)


def run_binary(main: Callable[[list], Any], argv: Optional[Sequence[str]] = None) -> int:
  """The binaries' one command-line path: `main(argv)` (default sys.argv[1:]) and its exit
  status. A user's mistake (USER_ERRORS: bad flags, bindings, values or paths, each naming the
  value and the fix) prints `Error: <message>` on stderr and gives 1, no traceback. An int
  that `main` returns is the status (a dry run's 1: a stage does not fit), anything else 0."""
  argv = list(sys.argv[1:] if argv is None else argv)
  try:
    result = main(argv)
  except USER_ERRORS as error:
    print(f"Error: {error}", file=sys.stderr, flush=True)
    return 1
  return result if isinstance(result, int) else 0


# --- the dry run's edge ------------------------------------------------------------------------

DRY_RUN_FLAG = "--dry_run"


@dataclasses.dataclass(frozen=True)
class DryRunSettings:
  """What `--dry_run` checks against: a slice's chip and device count."""

  slice_name: str
  chip: Any  # training.dry_run.Chip
  devices: int
  peak_fraction: float
  proxy_data: Any  # int or None


def take_dry_run_flag(argv: Sequence[str]) -> tuple[bool, list]:
  """(whether argv asks for a dry run, argv without the flag); refuses the multi-host flags
  with it (a dry run is one process)."""
  argv = list(argv)
  wanted = DRY_RUN_FLAG in argv
  if wanted:
    argv = [a for a in argv if a != DRY_RUN_FLAG]
    multi = [a for a in argv if a.split("=")[0] in ("--coordinator_address", "--process_count",
                                                    "--process_index")]
    if multi:
      raise GinConfigError(f"--dry_run runs in one process; drop {multi} (it simulates the "
                           "slice's devices itself).")
  return wanted, argv


def dry_run_settings(slice: str = "v4-8",  # pylint: disable=redefined-builtin
                     peak_fraction: float = 0.4, proxy_data: Any = 2) -> DryRunSettings:
  """gin: `SLICE = 'v4-32'` (train_base.gin, paper_base.gin binds `dry_run.slice = %SLICE`);
  `dry_run.peak_fraction`: the fraction of the chip's peak the step-time estimate assumes;
  `dry_run.proxy_data`: compile (d, m) as (proxy_data, m) on simulated devices (None: not)."""
  from distillspec_jax.training import dry_run
  from distillspec_jax.core.validation import check_positive_int
  from distillspec_jax.core.validation import check_probability
  name, chip, devices = dry_run.parse_slice(slice)
  check_probability(peak_fraction, "dry_run.peak_fraction", zero=False, fix="pass e.g. 0.4.")
  if proxy_data is not None:
    check_positive_int(proxy_data, "dry_run.proxy_data")
  return DryRunSettings(name, chip, devices, float(peak_fraction), proxy_data)


def start_dry_run() -> DryRunSettings:
  """The gin-bound settings, with this process's XLA_FLAGS set to simulate the slice's devices
  (call after parsing gin, before anything starts JAX's backend)."""
  from distillspec_jax.training import dry_run
  settings = configurable("dry_run")()
  dry_run.set_simulation_flags(settings.devices)
  return settings


@dataclasses.dataclass(frozen=True)
class DryRunPlan:
  """What a binary's --dry_run compiles: its stages (training.dry_run.Stage), the gin mesh
  sizes (DATA_PARALLEL, MODEL_PARALLEL), and the levers to suggest when one does not fit."""

  stages: list
  mesh: tuple
  levers: tuple = ()


def run_dry_run(plan_of: Callable[[], DryRunPlan]) -> int:
  """The binaries' one --dry_run (after gin is parsed): the slice's devices simulated, then
  `plan_of()` (it may build models: JAX starts after the simulation flags are set), every
  stage compiled for the mesh and the slice, the table printed; 0 when every stage fits,
  else 1. A mesh, batch or model axis that cannot work is a GinConfigError."""
  from distillspec_jax.training import dry_run
  settings = start_dry_run()  # before JAX starts: the slice's simulated devices
  plan = plan_of()
  try:
    devices = dry_run.dry_run_devices(settings.devices)
    rows = dry_run.run(plan.stages, plan.mesh, devices, settings.chip,
                       proxy_data=settings.proxy_data, peak_fraction=settings.peak_fraction)
  except ValueError as error:
    raise GinConfigError(f"--dry_run for {settings.slice_name}: {error}") from None
  return finish_dry_run(rows, plan.stages, devices, settings, plan.levers)


def finish_dry_run(rows: list, stages: list, devices: list, settings: DryRunSettings,
                   levers: Sequence[str] = ()) -> int:
  """Prints the table and the failures; 0 when every stage fits, else 1."""
  from distillspec_jax.training import dry_run
  text, messages = dry_run.report(rows, stages, devices, settings.chip, levers)
  print(f"\nDry run for {settings.slice_name} ({settings.devices} x {settings.chip.name}, "
        f"{settings.chip.hbm_gib:g} GiB HBM, {settings.chip.peak_tflops:g} TFLOP/s bf16 peak); "
        f"GiB per device; step time = FLOPs / ({settings.peak_fraction:.0%} of peak): an "
        "estimate. temp is the XLA:CPU figure when simulated (an estimate of the TPU's).\n")
  print(text, flush=True)
  for message in messages:
    print(f"DOES NOT FIT: {message}", file=sys.stderr, flush=True)
  return 1 if messages else 0


def clear() -> None:
  """Forgets all bindings (tests parse several configs in one process)."""
  gin.clear_config()


if __name__ == "__main__":
  if sys.argv[1:] == ["--write_model_gin"]:
    write_model_gin_files()
  else:
    print("usage: python -m distillspec_jax.gin_utils --write_model_gin", file=sys.stderr)
    sys.exit(2)
