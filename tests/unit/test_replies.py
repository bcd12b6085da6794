"""The transition functions' reply codes are named once in Lua (helpers.lua) and once in Python
(``Reply``): the two lists must be the same, name for name and value for value."""

from __future__ import annotations

import re
from importlib import resources

from orchestrator.store.replies import Reply

LUA = resources.files("orchestrator.store") / "lua"


def test_helpers_lua_names_the_reply_codes_as_the_enum_does() -> None:
    source = (LUA / "helpers.lua").read_text(encoding="utf-8")
    found = re.search(r"^local ([A-Z_, ]+) = ([0-9, ]+)$", source, re.MULTILINE)
    assert found is not None, "helpers.lua no longer names its reply codes in one line"
    names = [n.strip() for n in found.group(1).split(",")]
    values = [int(v) for v in found.group(2).split(",")]
    assert dict(zip(names, values, strict=True)) == {r.name: r.value for r in Reply}


def test_no_other_lua_file_names_reply_codes_of_its_own() -> None:
    for path in LUA.iterdir():
        if path.name.endswith(".lua") and path.name != "helpers.lua":
            text = path.read_text(encoding="utf-8")
            assert not re.search(r"^local (APPLIED|DUPLICATE|CONFLICT)\b", text, re.MULTILINE), path.name
