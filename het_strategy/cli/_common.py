"""What the Hydra command-line tools (``het-plan``, ``het-train``) share.

1. ``compose_config`` composes a shipped primary config (``het_strategy.configs``)
   with Hydra overrides through Hydra's compose API, so the tools never change
   the working directory nor create output folders.  ``group=<file.yaml>`` is
   accepted for the ``cluster`` and ``model`` groups: the file is read
   with ``core.files.read_yaml_file`` (a directory, pipe, unreadable, empty or
   malformed file: one error naming the group and the file) and staged as an
   option of that group in a temporary search-path folder, so further overrides
   such as ``cluster.inter_node_bandwidth_gbs=5`` still apply to it.  The
   composed group is then checked by its loader, so an error in the file's
   content names the file.
2. Hydra's own errors (unknown key, unknown group option, bad override syntax,
   a value a structured schema refuses: ``schema_error``) become ``ConfigError``
   with a one-line message naming the full field, the value and the rule; an
   unknown key lists the keys its section allows, and ``+key=value`` is
   suggested only where the section allows that key.  A ``+key=value`` that
   adds a top-level key no tool reads is refused.
3. ``cluster_from_cfg`` / ``workload_from_cfg`` turn the composed groups into the planning core's typed specs.
4. ``run_cli`` runs a tool's body and turns every ``ConfigError`` into
   ``<prog>: error: <message>`` on stderr and exit code 2, without a traceback.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from het_strategy.core.errors import ConfigError, field_error
from het_strategy.core.files import naming_file, read_yaml_file
from het_strategy.core.shipped import shipped_names

if TYPE_CHECKING:
    from het_strategy.core.cluster import ClusterSpec
    from het_strategy.core.workload import WorkloadSpec

__all__ = [
    "CONFIG_MODULE",
    "FILE_GROUPS",
    "EXIT_CONFIG_ERROR",
    "compose_config",
    "cfg_to_dict",
    "schema_error",
    "cluster_from_cfg",
    "workload_from_cfg",
    "run_cli",
]

CONFIG_MODULE = "het_strategy.configs"
FILE_GROUPS = ("cluster", "model")
EXIT_CONFIG_ERROR = 2
_YAML_SUFFIXES = (".yaml", ".yml")
_STAGED_PREFIX = "file_"


def compose_config(config_name: str, overrides: Sequence[str] = (),
                   file_groups: Sequence[str] = FILE_GROUPS, choices: dict[str, Any] | None = None) -> DictConfig:
    """Compose ``config_name`` from the shipped configs with Hydra ``overrides``.

    ``<group>=<path.yaml>`` for a group in ``file_groups`` loads that file as the
    group's option.  Groups whose YAML lacks a ``name`` get the option name (or
    the file's stem) as ``name``.  Raises ``ConfigError`` for every bad input.
    Works inside or outside another ``hydra.initialize*`` context.  ``choices``, when given, receives
    the chosen option of every group (``{"strategy": "ddp", ...}``; a staged file: its stem).
    """
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from hydra.initialize import get_gh_backup, restore_gh_from_backup

    overrides = [str(o) for o in overrides]
    backup = get_gh_backup()
    GlobalHydra.instance().clear()
    try:
        with tempfile.TemporaryDirectory(prefix="het_cfg_") as staging:
            overrides, files = _stage_group_files(overrides, Path(staging), file_groups)
            try:
                with initialize_config_module(version_base="1.3", config_module=CONFIG_MODULE,
                                              job_name=config_name):
                    cfg = compose(config_name, overrides=overrides, return_hydra_config=True)
            except Exception as exc:  # Hydra raises several unrelated types; all mean bad input here
                error = _hydra_error(exc, overrides, file_groups)
                group = str(error.field or "").split(".")[0]
                if group not in files:
                    raise error from None
                with naming_file(files[group], f"{group} file"):
                    raise error from None
    finally:
        GlobalHydra.instance().clear()
        restore_gh_from_backup(backup)
    file_names = {_staged_option(path): path.stem for path in files.values()}
    chosen = {str(k): file_names.get(str(v), v) for k, v in cfg.hydra.runtime.choices.items()
              if not str(k).startswith("hydra/")}
    _refuse_added_top_keys(cfg, overrides, chosen)
    if choices is not None:
        choices.update(chosen)
    with open_dict(cfg):
        del cfg["hydra"]
        for group in file_groups:
            node = cfg.get(group)
            # a structured schema may declare `name` (null): a null name is filled as a missing one
            if isinstance(node, DictConfig) and node.get("name") is None:
                node["name"] = str(chosen.get(group) or group)
    for group, path in files.items():
        with naming_file(path, f"{group} file"):
            _check_group(cfg, group)
    return cfg


def _staged_option(path: Path) -> str:
    """The group option a staged file becomes (a name Hydra's override grammar accepts)."""
    return _STAGED_PREFIX + re.sub(r"[^A-Za-z0-9_]", "_", path.stem)


def _stage_group_files(overrides: list[str], staging: Path, file_groups: Sequence[str]
                       ) -> tuple[list[str], dict[str, Path]]:
    """Rewrite ``group=<file.yaml>`` into a staged option of ``group`` on a temporary search path; returns the
    rewritten overrides and the file each staged group came from."""
    out: list[str] = []
    files: dict[str, Path] = {}
    for ov in overrides:
        key, sep, value = ov.partition("=")
        group = key.lstrip("+~")
        if sep and group in file_groups and value.lower().endswith(_YAML_SUFFIXES):
            path = Path(value).expanduser()
            if not os.path.lexists(path):
                raise field_error(group, value, f"be a shipped {group} name or an existing .yaml file",
                                  f"shipped: {', '.join(shipped_names(group))}")
            path, raw = read_yaml_file(path, group, f"{group} YAML file")
            option = _staged_option(path)
            target = staging / group / f"{option}.yaml"
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(yaml.safe_dump(raw, sort_keys=False))
            files[group] = path
            out.append(f"{key}={option}")
        else:
            out.append(ov)
    if files:
        out.append(f"hydra.searchpath=[{staging.resolve().as_uri()}]")
    return out, files


def _check_group(cfg: DictConfig, group: str) -> None:
    """Check a composed group that came from a user's file with its loader's rules (a structured group is
    checked by its schema while Hydra composes)."""
    node = cfg.get(group)
    if not isinstance(node, DictConfig) or OmegaConf.get_type(node) is not dict:
        return
    if group == "cluster":
        from het_strategy.core.cluster import cluster_from_dict

        cluster_from_dict(cfg_to_dict(node, group))
    elif group == "model":
        from het_strategy.core.workload import transformer_config

        transformer_config(cfg_to_dict(node, group))


def _section_keys(key: str, parent: Any) -> list[str]:
    """The keys the section holding ``key`` allows: a structured schema's fields, a cluster's or a model's
    keys, or (a section no schema describes) the keys it holds."""
    parts = key.split(".")
    if isinstance(parent, DictConfig):
        owner = OmegaConf.get_type(parent)
        if isinstance(owner, type) and dataclasses.is_dataclass(owner):
            return sorted(f.name for f in dataclasses.fields(owner))
    if len(parts) == 2 and parts[0] == "cluster":
        from het_strategy.core.cluster import CLUSTER_KEYS

        return sorted(CLUSTER_KEYS)
    if len(parts) == 2 and parts[0] == "model":
        from het_strategy.core.workload import MODEL_KEYS

        return sorted(MODEL_KEYS)
    if isinstance(parent, DictConfig):
        return sorted(str(k) for k in parent.keys() if not (len(parts) == 1 and str(k) == "hydra"))
    return []


def _refuse_added_top_keys(cfg: DictConfig, overrides: Sequence[str], groups: Mapping[str, Any]) -> None:
    """Refuse ``+key=value`` adding a top-level key that is no config group: no tool reads it."""
    added = []
    for ov in overrides:
        key, sep, value = ov.partition("=")
        if sep and key.startswith("+") and not key.startswith("++"):
            name = key[1:]
            if "." not in name and name not in groups and not name.startswith("hydra"):
                added.append((name, value))
    if added:
        name, value = added[0]
        new = {n for n, _ in added}
        known = sorted(str(k) for k in cfg.keys() if str(k) != "hydra" and str(k) not in new)
        raise field_error(name, value, "not be there: unknown key", f"known keys here: {', '.join(known)}")


def _override_value(overrides: Sequence[str], full_key: str) -> Any:
    for ov in reversed(overrides):
        key, _, value = ov.partition("=")
        if key.lstrip("+~") == full_key:
            return value
    return None


def _override_below(overrides: Sequence[str], full_key: str) -> tuple[str, str] | None:
    """The key and value of the last override that sets something inside ``full_key``, or None."""
    for ov in reversed(overrides):
        key, sep, value = ov.partition("=")
        if sep and key.lstrip("+~").startswith(full_key + "."):
            return key.lstrip("+~"), value
    return None


def _omegaconf_cause(exc: BaseException) -> OmegaConfBaseException | None:
    """The OmegaConf error naming a key behind a Hydra error (overrides: one level down; group files: more)."""
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
            return None
        if isinstance(seen, OmegaConfBaseException) and getattr(seen, "full_key", None):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def schema_error(exc: OmegaConfBaseException, value: Any = None) -> ConfigError:
    """One-line ConfigError for a value a structured schema refused: the full key, the value (``value``: the
    override's text, when known) and the rule the field's type sets (``be a number`` for a float, ...)."""
    key = str(getattr(exc, "full_key", "") or "config")
    shown = value if value is not None else getattr(exc, "value", None)
    parent = getattr(exc, "parent_node", None)
    element = re.fullmatch(r"(.+)\[\d+\]", key)  # an item of a list field (model_input.shape[0])
    if element and isinstance(parent, ListConfig):
        parent = parent._get_parent()
    name = (element.group(1) if element else key).rsplit(".", 1)[-1]
    kind = None
    if isinstance(parent, DictConfig):
        owner = OmegaConf.get_type(parent)
        if isinstance(owner, type) and dataclasses.is_dataclass(owner):
            kind = {f.name: f.type for f in dataclasses.fields(owner)}.get(name)
    if kind is None:
        return field_error(key, shown, f"be a valid value ({str(exc).splitlines()[0]})")
    text = str(getattr(kind, "__name__", kind))  # "float", "Optional[int]", ... (annotations may be strings)
    nullable = "Optional" in text or "None" in text  # Optional[X] or X | None
    options = _enum_options(owner, name)
    if options is not None:  # an option field (StrEnum): Hydra matches the member names
        return field_error(key, shown, f"be one of {', '.join(options)}" + (" or null" if nullable else ""))
    listed = re.search(r"(?:list|tuple|List|Tuple)\[(\w+)", text)
    if listed:  # Optional[list[str]], tuple[int, ...]: the whole list, or one item of it
        singular = {"str": "a string", "int": "an integer", "float": "a number", "bool": "true or false"}
        plural = {"str": "strings", "int": "integers", "float": "numbers", "bool": "booleans"}
        item = listed.group(1)
        if element:
            return field_error(key, shown, f"be {singular.get(item, item)}")
        return field_error(key, shown, f"be a list of {plural.get(item, item)}" + (" or null" if nullable else ""))
    for name, rule in (("bool", "be true or false"), ("int", "be an integer"), ("float", "be a number"),
                       ("str", "be a string")):
        if name in text:
            return field_error(key, shown, rule + (" or null" if nullable else ""))
    return field_error(key, shown, f"be of type {text}")


def _enum_options(owner: type, name: str) -> list[str] | None:
    """The member names of field ``name`` of dataclass ``owner`` when its type is an Enum (or Optional one)."""
    import enum
    import typing

    try:
        kind = typing.get_type_hints(owner).get(name)
    except Exception:  # an annotation that does not resolve: no options to list
        return None
    for candidate in (kind, *typing.get_args(kind)):
        if isinstance(candidate, type) and issubclass(candidate, enum.Enum):
            return list(candidate.__members__)
    return None


def _hydra_error(exc: Exception, overrides: Sequence[str], file_groups: Sequence[str]) -> ConfigError:
    """One-line ConfigError for a Hydra composition failure."""
    from hydra.errors import MissingConfigException, OverrideParseException

    if isinstance(exc, ConfigError):
        return exc
    cause = _omegaconf_cause(exc)
    if cause is not None:
        key = str(cause.full_key)
        msg = str(cause).splitlines()[0]
        if isinstance(cause, (ConfigAttributeError, ConfigKeyError)) and "not in" in msg:
            known = _section_keys(key, getattr(cause, "parent_node", None))
            value = _override_value(overrides, key)
            below = _override_below(overrides, key) if value is None else None
            if below is not None:  # `train.global_batch_size=8` where there is no `train` section
                fix = f"known keys at its level: {', '.join(known)}" if known else "check the spelling"
                if key == "train" and "settings" in known:  # het-plan's training settings section
                    fix = f"het-plan's training settings are `settings.*`: write `settings.{below[0].split('.', 1)[1]}`"
                return field_error(below[0], below[1], f"not be there: `{key}` is no section of this config", fix)
            if key.rsplit(".", 1)[-1] in known:
                return field_error(key, value, "be set with `+` here: the key is allowed but this config does "
                                   "not set it", f"write `+{key}={value if value is not None else '...'}`")
            fix = f"known keys here: {', '.join(known)}" if known else "check the spelling"
            return field_error(key, value, "not be there: unknown key", fix)
        return schema_error(cause, _override_value(overrides, key))
    if isinstance(exc, MissingConfigException):
        match = re.search(r"Could not find '([^/']+)/([^']+)'", str(exc))
        if match:
            group, option = match.groups()
            how = " or a path to a .yaml file" if group in file_groups else ""
            return field_error(group, option, f"be a shipped {group} name{how}",
                               f"shipped: {', '.join(shipped_names(group))}")
        return ConfigError(str(exc).splitlines()[0], field="config")
    if isinstance(exc, OverrideParseException):
        bad = [o for o in overrides if "=" not in o]
        detail = str(exc).splitlines()[0]
        return ConfigError(f"override is not valid ({detail}); overrides look like `key=value`, `+key=value` "
                           f"or `group=option`" + (f"; got {bad[0]!r}" if bad else ""), field="override")
    lines = [ln for ln in str(exc).splitlines() if ln.strip()]
    return ConfigError(lines[0] if lines else type(exc).__name__, field="config")


# -- groups -> typed specs ------------------------------------------------------------------------

def cfg_to_dict(node: Any, where: str) -> dict[str, Any]:
    """A config node as a plain dict with interpolations resolved; ConfigError otherwise."""
    if isinstance(node, Mapping) and not isinstance(node, DictConfig):
        return dict(node)
    if not isinstance(node, DictConfig):
        raise field_error(where, node, "be a mapping")
    try:
        out = OmegaConf.to_container(node, resolve=True)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"`{where}` cannot be resolved: {str(exc).splitlines()[0]}", field=where) from None
    assert isinstance(out, dict)
    return out


def cluster_from_cfg(cfg: DictConfig) -> "ClusterSpec":
    """The ClusterSpec of ``cfg.cluster``."""
    from het_strategy.core.cluster import cluster_from_dict

    return cluster_from_dict(_named_group(cfg, "cluster"))


def workload_from_cfg(cfg: DictConfig, dtype: str) -> "WorkloadSpec":
    """The WorkloadSpec of ``cfg.model``, its activation figures in ``dtype``."""
    from het_strategy.core.workload import load_workload

    return load_workload(_named_group(cfg, "model"), dtype=dtype)


def _named_group(cfg: DictConfig, group: str) -> dict[str, Any]:
    """``cfg.<group>`` as a dict; without a ``name``, the group's Hydra choice (when composed with the
    hydra node) or the group's own name stands in."""
    raw = cfg_to_dict(cfg.get(group), group)
    if "name" not in raw:
        choice = OmegaConf.select(cfg, f"hydra.runtime.choices.{group}", default=None)
        raw["name"] = str(choice) if choice is not None else group
    return raw


# -- running ------------------------------------------------------------------------------------

def run_cli(prog: str, body: Callable[[], int | None]) -> int:
    """Run ``body``; bad input becomes ``<prog>: error: <message>`` on stderr and exit code 2."""
    try:
        return int(body() or 0)
    except ConfigError as exc:
        if not exc.reported_by_rank_zero:
            print(f"{prog}: error: {_one_line(str(exc))}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    except OmegaConfBaseException as exc:
        print(f"{prog}: error: {_one_line(str(exc))}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    except BrokenPipeError:
        # the reader went away (``het-plan | head``): stop quietly, as other command-line tools do
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130


def _one_line(text: str) -> str:
    return " ".join(line.strip() for line in text.splitlines() if line.strip())
