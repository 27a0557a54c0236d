"""The plan JSON format: its version, the errors of reading it, and the converters that read it back.

A plan saves as plain JSON (never a pickle): ``Plan.to_json`` / ``PipelinePlan.to_json``
write every field but the planner state (``problem``), and ``from_json`` reads it back,
checking the schema version and each field's type; an error names the field's path
(``stages[1].plan.ops``). Each class's own reader sits beside it (``single._plan_from_dict``,
``pipeline._pipeline_plan_from_dict``); what they share is here.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Mapping

from alpa_lab.cost.cluster import ClusterSpec, Collective

SCHEMA_VERSION = 1
PIPELINE_PLAN_TYPE = "pipeline"
"""``plan_type`` of a ``PipelinePlan``'s JSON (a single-mesh ``Plan``'s JSON has none)."""


class PlanFormatError(ValueError):
    """Plan JSON that is corrupt, of another schema version, or for another program."""



def _read_plan_file(path: str | Path) -> str:
    try:
        return Path(path).read_text()
    except OSError as exc:
        raise PlanFormatError(f"cannot read plan file {str(path)!r}: {exc.strerror}") from exc


def _plan_json(text: str, what: str) -> dict:
    """Plan JSON as a dict of this schema version; ``what`` ("plan", "pipeline plan") names it in errors."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PlanFormatError(f"{what} file is not valid JSON ({exc}); was it truncated or edited by hand?") from exc
    if not isinstance(data, dict) or "schema_version" not in data:
        raise PlanFormatError("this JSON is not an alpa_lab plan (no 'schema_version' field)")
    if data["schema_version"] != SCHEMA_VERSION:
        raise PlanFormatError(
            f"{what} schema version {data['schema_version']} is not supported by this alpa_lab "
            f"(expects {SCHEMA_VERSION}); re-plan the step to get a current plan"
        )
    return data



def _collectives(items: list) -> tuple[Collective, ...]:
    return tuple(Collective(c["kind"], tuple(c["axes"]), float(c["nbytes"]), float(c["cost"])) for c in items)



# ----- typed fields (pipeline plan JSON) -------------------------------------------------


class _FieldError(ValueError):
    """A malformed field of pipeline plan JSON; the message starts with its path (``stages[1].plan``)."""


class _MissingField(_FieldError):
    """A required field absent from pipeline plan JSON; ``args[0]`` is its path."""



def _number(x: Any) -> float:
    """A JSON number kept as written (an int stays an int), so figures round-trip exactly."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise TypeError(f"expected a number, got {x!r}")
    return x


def _integer(x: Any) -> int:
    if isinstance(x, bool) or not isinstance(x, int):
        raise TypeError(f"expected an integer, got {x!r}")
    return x


def _text(x: Any) -> str:
    if not isinstance(x, str):
        raise TypeError(f"expected a string, got {x!r}")
    return x


def _flag(x: Any) -> bool:
    if not isinstance(x, bool):
        raise TypeError(f"expected true or false, got {x!r}")
    return x


def _array(item: Any) -> Any:
    def convert(x: Any) -> tuple:
        if not isinstance(x, list):
            raise TypeError(f"expected a list, got {x!r}")
        return tuple(item(v) for v in x)

    return convert


def _optional(item: Any) -> Any:
    return lambda x: None if x is None else item(x)


def _as_tuples(x: Any) -> Any:
    """JSON lists back to tuples, for fields without a converter of their own."""
    return tuple(_as_tuples(v) for v in x) if isinstance(x, list) else x


def _from_dict(cls: type, d: Any, where: str, convert: Mapping[str, Any]) -> Any:
    """``cls`` from its JSON object: each field through its converter; errors name the field's path."""
    if not isinstance(d, dict):
        raise _FieldError(f"{where or 'the plan'}: expected a JSON object, got {type(d).__name__}")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name == "problem" or not f.init:
            continue
        path = f"{where}.{f.name}" if where else f.name
        if f.name not in d:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise _MissingField(path)
            continue
        fn = convert.get(f.name, _as_tuples)
        try:
            kwargs[f.name] = fn(d[f.name], path) if getattr(fn, "wants_path", False) else fn(d[f.name])
        except _FieldError:
            raise  # a nested field's error already names its path
        except KeyError as exc:
            raise _MissingField(f"{path}.{exc.args[0]}") from exc
        except (TypeError, ValueError, AttributeError) as exc:
            raise _FieldError(f"{path}: {exc}") from exc
    return cls(**kwargs)


def _with_path(fn: Any) -> Any:
    fn.wants_path = True
    return fn



def _cluster(d: Any) -> dict[str, Any]:
    if not isinstance(d, dict):
        raise TypeError(f"expected a JSON object, got {d!r}")
    try:
        ClusterSpec(**d)  # the fields of a cluster, with valid values
    except (TypeError, ValueError) as exc:
        raise ValueError(f"not a valid ClusterSpec ({exc})") from exc
    return dict(d)


def _seconds(d: Any) -> dict[str, float]:
    if not isinstance(d, dict):
        raise TypeError(f"expected a JSON object, got {d!r}")
    return {_text(k): _number(v) for k, v in d.items()}

