"""The README's table of profile fields is the profile's declarations (`molctl.profilespec`,
`setting`): every declared field with its type, default and doc line, and nothing else.

`python -m tests.cli.test_readme_profile_fields` prints the table's rows from the declarations, to
paste into the README when a field is added."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from molctl import profiles as pf
from molctl.profilespec import declared
from molctl.profileyaml import _ListOf, _MapOf

README = Path(__file__).resolve().parents[2] / "README.md"
HEADING = "### Profile fields"
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


def default_text(f: dataclasses.Field) -> str:
    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
        return "required"
    value = f.default_factory() if f.default is dataclasses.MISSING else f.default
    if isinstance(value, tuple):
        value = list(value)
    elif isinstance(value, Mapping):
        value = dict(value)
    return f"`{json.dumps(value)}`"


def schema_fields(cls: type = pf.Profile, prefix: str = "") -> Iterator[tuple[str, str, str, str]]:
    """(field, type, default, doc) of every declared field (`molctl.profilespec.setting`), in order."""
    for name, f in declared(cls):
        if "section" in f.metadata:
            yield from schema_fields(f.metadata["section"], f"{prefix}{name}.")
        else:
            yield prefix + name, type_text(f.metadata["spec"]), default_text(f), f.metadata["doc"]


def readme_fields() -> list[tuple[str, str, str, str]]:
    """(field, type, default, doc) of each row of the README's table under HEADING."""
    text = README.read_text()
    assert HEADING in text, f"README.md has no {HEADING!r} section"
    rows = []
    for line in text.split(HEADING, 1)[1].splitlines():
        if rows and not line.startswith("|"):
            break
        if line.startswith("| `"):
            cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
            rows.append((cells[0].strip("`"), cells[1], cells[2], cells[3]))
    return rows


def test_every_schema_field_is_in_the_table():
    documented = {f for f, *_ in readme_fields()}
    missing = [f for f, *_ in schema_fields() if f not in documented]
    assert not missing, f"README.md's profile field table lacks {missing}"


def test_the_table_names_no_field_the_schema_lacks():
    known = {f for f, *_ in schema_fields()}
    extra = [f for f, *_ in readme_fields() if f not in known]
    assert not extra, f"README.md's profile field table names fields the schema lacks: {extra}"


def test_each_field_is_in_the_table_once():
    names = [f for f, *_ in readme_fields()]
    assert len(names) == len(set(names))


def test_types_defaults_and_docs_are_the_declarations():
    expected = {f: rest for f, *rest in schema_fields()}
    wrong = [
        f"{f}: table says {tuple(rest)!r}; the declaration says {expected[f]}"
        for f, *rest in readme_fields()
        if f in expected and tuple(rest) != tuple(expected[f])
    ]
    assert not wrong, "\n".join(wrong)


if __name__ == "__main__":
    for field, type_, default, doc in schema_fields():
        print(f"| `{field}` | {type_} | {default} | {doc} |")
