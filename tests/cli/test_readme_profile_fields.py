"""The README's table of profile fields names every field of the profile schema
(`molctl.profiles.SCHEMA`) with its type and default, and nothing else.

`python -m tests.cli.test_readme_profile_fields` prints the field, type and default columns the
schema gives, to paste into the table when a field is added."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from molctl import profiles as pf
from molctl.profileyaml import _ListOf, _MapOf

README = Path(__file__).resolve().parents[2] / "README.md"
HEADING = "### Profile fields"
# the dataclass that holds each section's values, and so its defaults
SECTIONS = {
    "": pf.Profile,
    "model": pf.ModelSpec,
    "adapters": pf.AdapterSpec,
    "engine": pf.EngineSpec,
    "proxy": pf.ProxySpec,
    "logs": pf.LogSpec,
    "prompts": pf.Prompts,
}
TYPE_WORDS = {str: "string", int: "integer", float: "number", bool: "boolean", type(None): "null"}


def type_text(spec: Any) -> str:
    if spec == (int, float):
        return "number"
    if isinstance(spec, tuple):
        return " or ".join(type_text(s) for s in spec)
    if isinstance(spec, _ListOf):
        return (
            f"list of ({type_text(spec.item)})" if isinstance(spec.item, tuple) else f"list of {type_text(spec.item)}"
        )
    if isinstance(spec, _MapOf):
        return f"map of ({type_text(spec.item)})" if isinstance(spec.item, tuple) else f"map of {type_text(spec.item)}"
    return TYPE_WORDS[spec]


def default_text(dotted: str) -> str:
    if dotted in pf.REQUIRED:
        return "required"
    section, _, name = dotted.rpartition(".")
    (f,) = [f for f in dataclasses.fields(SECTIONS[section]) if f.name == name]
    value = f.default_factory() if f.default is dataclasses.MISSING else f.default
    if isinstance(value, tuple):
        value = list(value)
    elif isinstance(value, Mapping):
        value = dict(value)
    return f"`{json.dumps(value)}`"


def schema_fields(schema: Mapping[str, Any] = pf.SCHEMA, prefix: str = "") -> Iterator[tuple[str, str, str]]:
    """(field, type, default) of every leaf of the schema, in its order."""
    for key, spec in schema.items():
        dotted = prefix + key
        if isinstance(spec, dict):
            yield from schema_fields(spec, dotted + ".")
        else:
            yield dotted, type_text(spec), default_text(dotted)


def readme_fields() -> list[tuple[str, str, str]]:
    """(field, type, default) of each row of the README's table under HEADING."""
    text = README.read_text()
    assert HEADING in text, f"README.md has no {HEADING!r} section"
    rows = []
    for line in text.split(HEADING, 1)[1].splitlines():
        if rows and not line.startswith("|"):
            break
        if line.startswith("| `"):
            cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
            rows.append((cells[0].strip("`"), cells[1], cells[2]))
    return rows


def test_every_schema_field_is_in_the_table():
    documented = {f for f, _, _ in readme_fields()}
    missing = [f for f, _, _ in schema_fields() if f not in documented]
    assert not missing, f"README.md's profile field table lacks {missing}"


def test_the_table_names_no_field_the_schema_lacks():
    known = {f for f, _, _ in schema_fields()}
    extra = [f for f, _, _ in readme_fields() if f not in known]
    assert not extra, f"README.md's profile field table names fields the schema lacks: {extra}"


def test_each_field_is_in_the_table_once():
    names = [f for f, _, _ in readme_fields()]
    assert len(names) == len(set(names))


def test_types_and_defaults_are_the_schemas():
    expected = {f: (t, d) for f, t, d in schema_fields()}
    wrong = [
        f"{f}: table says {t!r}, {d!r}; schema says {expected[f]}"
        for f, t, d in readme_fields()
        if f in expected and (t, d) != expected[f]
    ]
    assert not wrong, "\n".join(wrong)


if __name__ == "__main__":
    for field, type_, default in schema_fields():
        print(f"| `{field}` | {type_} | {default} |")
