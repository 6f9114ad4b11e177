"""Command-line options generated from a typed config dataclass, with named presets.

A pipeline writes its options once, as dataclass fields with `option(default, help)`; every field
becomes a `--flag`, and `--preset NAME` picks the defaults (e.g. cpu or gpu) that flags then
override.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import shlex
import signal
import sys
import traceback
import types
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

from raytrain_common.options import help_of
from raytrain_common.options import option as option  # pipelines import it from here

Config = TypeVar("Config")


CommandSpec = tuple[str, type] | tuple[str, type, Mapping[str, Any]]


def command_parser(
    program: str, description: str, commands: Mapping[str, CommandSpec]
) -> argparse.ArgumentParser:
    """A pipeline's parser: one sub-command per entry of `commands`, `{name: (help, config class)}`
    or `{name: (help, config class, presets)}`, each field of the class a flag (see
    `add_config_options`). Each sub-command remembers its class and presets, so `run_commands` can
    read the run a `train` was given when it is interrupted."""
    parser = argparse.ArgumentParser(prog=program, description=description)
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name, (help_text, config_class, *presets) in commands.items():
        command = subparsers.add_parser(name, help=help_text)
        add_config_options(command, config_class, *presets)
        command.set_defaults(config_source=(config_class, *presets))
    return parser


def user_errors(*pipeline_errors: type[BaseException]) -> tuple[type[BaseException], ...]:
    """The errors that mean bad input, to end in one line (`run_commands`): the library's own (a
    bad option, storage, the cluster's resources, a missing or existing file, a torn checkpoint,
    text and tokenisation) and the pipeline's."""
    from raytrain_common.checkpoint import TornCheckpointError
    from raytrain_common.configs import ConfigError
    from raytrain_common.pretokenize import TokenizeError
    from raytrain_common.ray_start import ResourceError
    from raytrain_common.storage import StorageError
    from raytrain_common.text import TextEncodingError

    library: tuple[type[BaseException], ...] = (
        ConfigError,
        StorageError,
        ResourceError,
        FileNotFoundError,
        FileExistsError,
        TornCheckpointError,
        TokenizeError,
        TextEncodingError,
    )
    return (*pipeline_errors, *library)


class _DeprecatedFlag(argparse.Action):
    """A former name of a flag: sets the same field and says, once, what the name is now."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        self.current = kwargs.pop("current")
        super().__init__(option_strings, dest, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        print(
            f"{parser.prog}: warning: {option_string} is deprecated "
            f"and goes in the next version: use {self.current}",
            file=sys.stderr,
        )
        setattr(namespace, self.dest, values)


def add_config_options(
    parser: argparse.ArgumentParser,
    config_class: type[Config],
    presets: Mapping[str, Config] | None = None,
) -> None:
    """Add one flag per field of `config_class`, and `--preset` when there are presets; defaults
    come from the first preset, or from the class itself.

    Flags default to "not given" so that `config_from_args` can tell a flag the user typed from a
    preset's value.
    """
    if presets:
        preset_names = list(presets)
        base = presets[preset_names[0]]
        parser.add_argument(
            "--preset",
            choices=preset_names,
            default=preset_names[0],
            help=f"named defaults that the flags below override (default: {preset_names[0]})",
        )
    else:
        base = config_class()
        presets = {"": base}
    hints = typing.get_type_hints(config_class)
    for field in dataclasses.fields(config_class):  # type: ignore[arg-type]
        if not field.init:
            continue
        default = getattr(base, field.name)
        shown = {name: getattr(preset, field.name) for name, preset in presets.items()}
        if len({repr(value) for value in shown.values()}) > 1:
            default_text = ", ".join(f"{name}: {value}" for name, value in shown.items())
        else:
            default_text = str(default)
        described = help_of(config_class, field.name).format_map(_ClassAttributes(config_class))
        help_text = f"{described} (default: {default_text})".strip()
        kwargs = _argparse_kwargs(hints[field.name], field.name)
        if field.metadata.get("positional"):
            kwargs["metavar"] = field.name.upper()
            parser.add_argument(
                field.name, nargs="?", default=argparse.SUPPRESS, help=help_text, **kwargs
            )
        else:
            flag = "--" + field.name.replace("_", "-")
            parser.add_argument(
                flag, dest=field.name, default=argparse.SUPPRESS, help=help_text, **kwargs
            )
            for former in field.metadata.get("deprecated", ()):
                alias = {
                    key: kwargs[key] for key in ("type", "metavar", "choices") if key in kwargs
                }
                parser.add_argument(
                    former,
                    dest=field.name,
                    default=argparse.SUPPRESS,
                    help=f"deprecated: {flag}",
                    action=_DeprecatedFlag,
                    current=flag,
                    **alias,
                )


def config_from_args(
    namespace: argparse.Namespace,
    config_class: type[Config],
    presets: Mapping[str, Config] | None = None,
) -> Config:
    """The chosen preset (or the class's defaults) with every flag the user gave applied on top."""
    names = {field.name for field in dataclasses.fields(config_class)}  # type: ignore[arg-type]
    given = {name: value for name, value in vars(namespace).items() if name in names}
    if not presets:
        config = config_class(**given)
    else:
        config = dataclasses.replace(presets[namespace.preset], **given)  # type: ignore[type-var]
    check_options = getattr(config, "check_options", None)
    if check_options is not None:  # a config's own checks of what the user typed (a run name)
        check_options()
    return config


class _ClassAttributes(dict[str, str]):
    """`str.format_map` source: a config class's attributes, e.g. its `data_folder`."""

    def __init__(self, config_class: type) -> None:
        super().__init__()
        self.config_class = config_class

    def __missing__(self, key: str) -> str:
        return str(getattr(self.config_class, key))


def _argparse_kwargs(hint: Any, name: str) -> dict[str, Any]:
    """argparse arguments for one annotated field: bools get --x/--no-x, Literals get choices."""
    optional = False
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        members = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        optional = len(members) < len(typing.get_args(hint))
        if len(members) != 1:
            raise TypeError(f"field {name!r}: only X | None unions become flags, got {hint}")
        hint = members[0]
    if hint is bool:
        return {"action": argparse.BooleanOptionalAction}
    if typing.get_origin(hint) is Literal:
        choices = list(typing.get_args(hint))
        return {"choices": choices, "type": type(choices[0])}
    if hint in (int, float, str):
        metavar = hint.__name__.upper() + ("|none" if optional else "")
        return {"type": _nullable(hint) if optional else hint, "metavar": metavar}
    raise TypeError(f"field {name!r}: type {hint} has no command-line form")


def _nullable(kind: type) -> typing.Callable[[str], Any]:
    def parse(text: str) -> Any:
        return None if text.lower() in ("none", "") else kind(text)

    parse.__name__ = kind.__name__
    return parse


def ray_is_connected() -> bool:
    """True when this process is connected to a Ray cluster (without importing Ray to find out)."""
    if "ray" not in sys.modules:
        return False
    import ray

    return bool(ray.is_initialized())


def end_ray_before_error_line(*, caller_holds_ray: bool = False) -> None:
    """Disconnect from Ray (if connected) before a command prints its one-line error.

    Ray streams the workers' and the controller's output into the driver's from a background
    thread; without this, tracebacks from the failed run can arrive after the error line and bury
    it. Disconnecting stops that stream; a local cluster this process started is shut down too.
    `caller_holds_ray`: the command's `main` was called in a process that was already connected
    (a notebook, a test session); that connection, and the cluster behind it, is the caller's to
    end, so it is left as it is.
    """
    if not caller_holds_ray and ray_is_connected():
        import ray

        ray.shutdown()


def report_known_failure(
    program: str, error: BaseException, *, caller_holds_ray: bool = False
) -> bool:
    """For a failure `raytrain_common.known_errors` recognises: print the real traceback, then one
    last line with the cause and the fix, and return True; return False for any other error (the
    caller re-raises it). Ray is disconnected first, so no streamed worker output lands after it
    (see `end_ray_before_error_line` for `caller_holds_ray`)."""
    from raytrain_common.known_errors import explain

    hint = explain(error)
    if hint is None:
        return False
    end_ray_before_error_line(caller_holds_ray=caller_holds_ray)
    traceback.print_exception(error, file=sys.stderr)
    print(f"{program}: {hint}", file=sys.stderr, flush=True)
    return True


def report_unwritable_storage(
    program: str, error: BaseException, args: argparse.Namespace, *, caller_holds_ray: bool = False
) -> bool:
    """For a disk that filled up or turned read-only under a command (anywhere in the error's
    chain), print one line naming the path and what to do, and return True; else return False.
    The traceback says little more, and the command cannot go on until someone acts."""
    from raytrain_common.storage import lasting_storage_problem

    problem = lasting_storage_problem(error)
    if problem is None:
        return False
    seen: BaseException | None = error
    where = None
    while seen is not None and where is None:
        where = getattr(seen, "filename", None)
        seen = seen.__cause__ or seen.__context__
    ours = [
        str(getattr(args, name))
        for name in ("storage_path", "data_dir")
        if getattr(args, name, None)
    ]
    end_ray_before_error_line(caller_holds_ray=caller_holds_ray)
    first_line = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
    if where is not None and not any(_is_under(str(where), path) for path in ours):
        print(  # not the storage: HOME on a read-only root, a temp folder, a cache
            f"{program}: error: {where} {problem} ({first_line}): the command writes there, "
            "outside its storage path; make it writable or move it (under a read-only root file "
            "system, HOME must be writable: Ray keeps its token in ~/.ray when it starts a local "
            "cluster), then rerun the same command",
            file=sys.stderr,
            flush=True,
        )
        return True
    where = where or getattr(args, "data_dir", None) or getattr(args, "storage_path", "./runs")
    print(
        f"{program}: error: the storage at {where} {problem} ({first_line}): free space there or "
        "give another --storage-path / --data-dir, then rerun the same command (a run resumes "
        "from its last complete checkpoint)",
        file=sys.stderr,
        flush=True,
    )
    return True


def _is_under(path: str, folder: str) -> bool:
    """Whether a local `path` is `folder` or inside it (a URI folder holds no local path)."""
    if "://" in folder:
        return False
    return Path(os.path.abspath(path)).is_relative_to(os.path.abspath(os.path.expanduser(folder)))


_RECEIVED: dict[str, int] = {}  # the signal `interruptible`'s handler last received


class Interrupted(KeyboardInterrupt):
    """SIGTERM (what Kubernetes sends a pod it stops), raised in the main thread as Ctrl-C is."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """While a command runs, SIGTERM stops it as Ctrl-C does (`Interrupted`), so both end through
    `report_interrupted`; the previous handler is back afterwards (a test session's, say)."""

    def stop(signum: int, frame: types.FrameType | None) -> None:
        # Kept aside too: an interrupt raised inside ray.get comes back out of Ray's C++ core as a
        # plain KeyboardInterrupt.
        _RECEIVED["signum"] = signum
        raise Interrupted(signum)

    stop.raytrain_interrupt = True  # type: ignore[attr-defined]  # ray_start.init_ray keeps it
    _RECEIVED.clear()
    try:
        previous = signal.signal(signal.SIGTERM, stop)
    except ValueError:  # not the main thread: SIGTERM keeps its handler
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def report_interrupted(
    program: str,
    argv: Sequence[str],
    error: KeyboardInterrupt,
    resume_point: Callable[[], str | None] | None = None,
    *,
    caller_holds_ray: bool = False,
) -> int:
    """A command stopped by Ctrl-C or SIGTERM: Ray disconnected first (a local cluster this process
    started is shut down with every process of it), then one line saying what stopped it, where
    the run resumes (`resume_point`: the newest complete checkpoint, or None before the first)
    and the command that continues it; the exit status a shell gives a process that signal ends
    (130 for Ctrl-C, 143 for SIGTERM)."""
    signum = error.signum if isinstance(error, Interrupted) else _RECEIVED.get("signum", 2)
    end_ray_before_error_line(caller_holds_ray=caller_holds_ray)
    what = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
    said = f"{program}: interrupted ({what})"
    if resume_point is not None:
        try:
            checkpoint = resume_point()
        except Exception as unreadable:  # the storage itself may be what went away
            checkpoint = f"(the run folder cannot be read: {unreadable})"
        said += (
            f"; it resumes from {checkpoint}"
            if checkpoint
            else "; no checkpoint was written yet, so it starts again from the beginning"
        )
    command = shlex.join([program.split()[0], *argv])
    again = "To continue" if resume_point is not None else "Run it again"
    print(f"{said}. {again}: {command}", file=sys.stderr, flush=True)
    return 128 + int(signum)


Command = Callable[[argparse.Namespace], int]


def run_commands(
    program: str,
    parser: argparse.ArgumentParser,
    commands: Mapping[str, Command],
    user_errors: tuple[type[BaseException], ...],
    argv: Sequence[str] | None = None,
) -> int:
    """A pipeline's `main`: parse, run the chosen command, and end every failure in one line.

    Bad input (`user_errors`, or one raised in a Ray task as such: its `cause`): one line naming
    it, exit status 2, no traceback. Ctrl-C or SIGTERM (Kubernetes stopping the pod): Ray
    disconnected, one line naming the newest checkpoint of the run `train` was given (its config
    read as `command_parser` set it up) and the command that continues it.
    An unwritable storage path: one line, 2. A known cause (out of memory, a collective timeout,
    a missing module, …): the traceback, then one line with its fix, 1. Anything else propagates
    as it is."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    command = f"{program} {args.command}"
    caller_holds_ray = ray_is_connected()
    try:
        with interruptible():
            return commands[args.command](args)
    except KeyboardInterrupt as error:
        newest = _newest_checkpoint(args) if args.command == "train" else None
        return report_interrupted(command, argv, error, newest, caller_holds_ray=caller_holds_ray)
    except user_errors as error:
        end_ray_before_error_line(caller_holds_ray=caller_holds_ray)
        cause = getattr(error, "cause", None)  # raised in a Ray task: its own line, no traceback
        shown = cause if isinstance(cause, user_errors) else error
        print(f"{command}: error: {shown}", file=sys.stderr)
        return 2
    except Exception as error:
        if report_unwritable_storage(command, error, args, caller_holds_ray=caller_holds_ray):
            return 2
        if not report_known_failure(command, error, caller_holds_ray=caller_holds_ray):
            raise
        return 1


def _newest_checkpoint(args: argparse.Namespace) -> Callable[[], str | None] | None:
    """The newest complete checkpoint of the run `args` name, looked up when asked (after Ray
    stopped); None when the command's parser did not come from `command_parser`."""
    if not hasattr(args, "config_source"):
        return None
    config = config_from_args(args, *args.config_source)

    def newest() -> str | None:
        from raytrain_common.checkpoint import newest_complete_checkpoint
        from raytrain_common.storage import resolve_storage

        run_dir = resolve_storage(config.storage_path).join(config.run_name)
        checkpoint = newest_complete_checkpoint(run_dir)
        return run_dir.uri_for(checkpoint.path) if checkpoint else None

    return newest
