"""Safe YAML loading: line numbers for every value, merge keys, and the limits and refusals that keep
hostile input (alias bombs, deep nesting, tags, duplicate keys) out."""

from __future__ import annotations

import textwrap

import pytest

from orchestrator.dsl.yaml_source import SourceMap, YamlLimits, load_yaml
from orchestrator.errors import DefinitionError, Problem

DOC = textwrap.dedent(
    """\
    # a comment before the document
    name: demo
    stages:
      - name: first
        input:
          modelId: "${context.modelId}"
          nested:
            - 1
            - [2, 3]
            - key: value
              other:
                deep: true
      - { name: second, on_success: completed }
      - name: third
        empty:
    output: { a: 1, b: [x, y] }
    """
)


def _problems(text: str, limits: YamlLimits | None = None) -> list[Problem]:
    with pytest.raises(DefinitionError) as info:
        load_yaml(text, "f.yaml", limits)
    assert info.value.problems
    return info.value.problems


def _load(text: str, limits: YamlLimits | None = None) -> object:
    return load_yaml(textwrap.dedent(text), "f.yaml", limits).data


# ---- data and line numbers -------------------------------------------------------------------------


def test_the_document_loads_as_plain_data() -> None:
    data = load_yaml(DOC, "f.yaml").data
    assert data["stages"][0]["input"]["nested"] == [1, [2, 3], {"key": "value", "other": {"deep": True}}]
    assert data["stages"][1] == {"name": "second", "on_success": "completed"}
    assert data["stages"][2]["empty"] is None
    assert data["output"] == {"a": 1, "b": ["x", "y"]}


@pytest.mark.parametrize(
    ("path", "line"),
    [
        ((), 2),  # the root starts at its first key, after the comment
        (("name",), 2),
        (("stages",), 3),
        (("stages", 0), 4),
        (("stages", 0, "name"), 4),
        (("stages", 0, "input"), 5),  # a block value is located at its key
        (("stages", 0, "input", "modelId"), 6),
        (("stages", 0, "input", "nested"), 7),
        (("stages", 0, "input", "nested", 0), 8),
        (("stages", 0, "input", "nested", 1), 9),
        (("stages", 0, "input", "nested", 1, 1), 9),
        (("stages", 0, "input", "nested", 2), 10),
        (("stages", 0, "input", "nested", 2, "other"), 11),
        (("stages", 0, "input", "nested", 2, "other", "deep"), 12),
        (("stages", 1), 13),
        (("stages", 1, "on_success"), 13),
        (("stages", 2, "empty"), 15),
        (("output", "b", 1), 16),
    ],
)
def test_every_value_has_its_line(path: tuple[object, ...], line: int) -> None:
    source = load_yaml(DOC, "f.yaml").source
    assert source.lines[path] == line
    assert source.line_for(path) == line


@pytest.mark.parametrize(
    ("path", "line"),
    [
        (("stages", 0, "input", "missing"), 5),
        (("stages", 0, "input", "nested", 2, "other", "deep", "x", 0), 12),
        (("stages", 1, "on_failure"), 13),
        (("stages", 7, "name"), 3),
        (("nowhere", "at", "all"), 2),
    ],
)
def test_line_for_an_unwritten_path_falls_back_to_the_nearest_ancestor(
    path: tuple[object, ...], line: int
) -> None:
    source = load_yaml(DOC, "f.yaml").source
    assert path not in source.lines
    assert source.line_for(path) == line


def test_an_empty_source_map_answers_line_one() -> None:
    assert SourceMap("f.yaml").line_for(("a", 0)) == 1


def test_bytes_are_read_as_utf8() -> None:
    loaded = load_yaml("name: café\n".encode(), "f.yaml")
    assert loaded.data == {"name": "café"}
    assert loaded.source.file == "f.yaml"


# ---- merge keys and aliases -----------------------------------------------------------------------


def test_a_merge_key_copies_the_anchored_mapping() -> None:
    data = _load(
        """\
        base: &base { type: action, retry: { max_attempts: 3 } }
        stage:
          <<: *base
          name: s
        """
    )
    assert data["stage"] == {"type": "action", "retry": {"max_attempts": 3}, "name": "s"}


def test_merged_values_are_located_at_the_anchor() -> None:
    source = load_yaml("base: &b\n  x: 1\nuse:\n  <<: *b\n  y: 2\n", "f.yaml").source
    assert source.lines[("use", "x")] == 2
    assert source.lines[("use", "y")] == 5


def test_an_explicit_key_overrides_a_merged_one() -> None:
    """YAML merge semantics: keys written in the mapping win over merged keys; that is not a duplicate."""
    data = _load(
        """\
        base: &base { type: action, on_success: completed, on_failure: failed }
        stage:
          <<: *base
          on_success: next
        """
    )
    assert data["stage"] == {"type": "action", "on_success": "next", "on_failure": "failed"}


def test_with_several_merged_mappings_the_first_wins() -> None:
    data = _load(
        """\
        a: &a { k: from-a, only_a: 1 }
        b: &b { k: from-b, only_b: 2 }
        c:
          <<: [*a, *b]
        """
    )
    assert data["c"] == {"k": "from-a", "only_a": 1, "only_b": 2}


def test_a_merge_key_must_merge_a_mapping() -> None:
    [problem] = _problems("a: &a [1, 2]\nb:\n  <<: *a\n")
    assert "invalid YAML" in problem.message


def test_aliases_expand_to_equal_values() -> None:
    data = _load(
        """\
        ids: &ids [a, b]
        name: &name shared
        copy: *ids
        again: *name
        """
    )
    assert data["copy"] == ["a", "b"]
    assert data["again"] == "shared"


def test_alias_limit_counts_collection_expansions() -> None:
    text = "a: &x { k: [1] }\n" + "".join(f"b{i}: *x\n" for i in range(3))
    # each *x expands the mapping and its list: two alias expansions per use
    assert load_yaml(text, "f.yaml", YamlLimits(max_aliases=6)).data["b2"] == {"k": [1]}
    [problem] = _problems(text, YamlLimits(max_aliases=5))
    assert "more than 5 alias expansions" in problem.message


def test_scalar_aliases_are_cheap_and_not_counted() -> None:
    text = "a: &s value\n" + "".join(f"b{i}: *s\n" for i in range(10))
    assert load_yaml(text, "f.yaml", YamlLimits(max_aliases=0)).data["b9"] == "value"


def test_billion_laughs_is_refused_quickly() -> None:
    lines = ["l0: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, 10)]
    [problem] = _problems("\n".join(lines) + "\n")
    assert "alias expansions" in problem.message
    assert "billion laughs" in problem.message


# ---- limits ---------------------------------------------------------------------------------------


def test_node_limit_is_inclusive() -> None:
    text = "a: [x, y]\n"  # the root, the key, the list and its two items
    assert load_yaml(text, "f.yaml", YamlLimits(max_nodes=5)).data == {"a": ["x", "y"]}
    [problem] = _problems(text, YamlLimits(max_nodes=4))
    assert "more than 4 values" in problem.message


def test_depth_limit_is_inclusive() -> None:
    assert load_yaml("a: [[x]]\n", "f.yaml", YamlLimits(max_depth=3)).data == {"a": [["x"]]}
    [problem] = _problems("a: [[[x]]]\n", YamlLimits(max_depth=3))
    assert problem.message == "nesting deeper than 3 levels"


def test_default_depth_limit_on_block_nesting_reports_the_line() -> None:
    text = "a:\n" + "".join("  " * (i + 1) + f"k{i}:\n" for i in range(70))
    [problem] = _problems(text)
    assert problem.message == "nesting deeper than 64 levels"
    assert problem.line == 65


@pytest.mark.parametrize("depth", [200, 1_000, 5_000])
def test_nesting_far_beyond_the_limit_is_a_definition_error_not_a_crash(depth: int) -> None:
    """A few kilobytes of brackets must not exhaust Python's recursion limit (RecursionError)."""
    [problem] = _problems("a: " + "[" * depth + "]" * depth + "\n")
    assert "nesting" in problem.message


def test_byte_limit() -> None:
    assert load_yaml("a: 12345\n", "f.yaml", YamlLimits(max_bytes=9)).data == {"a": 12345}
    [problem] = _problems("a: 123456\n", YamlLimits(max_bytes=9))
    assert problem.message == "file is 10 bytes, over the 9 limit"


def test_byte_limit_counts_utf8_bytes_not_characters() -> None:
    [problem] = _problems("a: ééé\n", YamlLimits(max_bytes=8))
    assert "file is 10 bytes" in problem.message


# ---- duplicate keys ---------------------------------------------------------------------------------


def test_duplicate_key_is_reported_with_both_lines() -> None:
    [problem] = _problems("name: a\nversion: '1'\nname: b\n")
    assert problem == Problem(
        "f.yaml", 3, "name", "duplicate key 'name' (first written on line 1); remove one of them"
    )


def test_nested_duplicates_are_all_reported_at_their_paths() -> None:
    text = textwrap.dedent(
        """\
        stages:
          - name: a
            on_success: b
            on_success: c
          - { name: b, type: x, type: y }
        """
    )
    problems = _problems(text)
    assert [(p.line, p.path) for p in problems] == [(4, "stages[0].on_success"), (5, "stages[1].type")]


def test_explicit_keys_duplicated_next_to_a_merge_are_still_duplicates() -> None:
    problems = _problems("base: &b { x: 1 }\nuse:\n  <<: *b\n  y: 1\n  y: 2\n")
    assert [p.path for p in problems] == ["use.y"]


# ---- tags and other refusals ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("a: !custom { x: 1 }\n", "tag '!custom' is not allowed"),
        ("a: !custom [1]\n", "tag '!custom' is not allowed"),
        ("a: !!set { x, y }\n", "tag 'tag:yaml.org,2002:set' is not allowed"),
        ("a: !!omap [ { x: 1 } ]\n", "tag 'tag:yaml.org,2002:omap' is not allowed"),
        ("a: !!pairs [ { x: 1 } ]\n", "tag 'tag:yaml.org,2002:pairs' is not allowed"),
        ("a: !custom scalar\n", "cannot read value"),
        ("a: !!python/object:os.system x\n", "cannot read value"),
        ("a: !!python/name:os.system ''\n", "cannot read value"),
        (
            "a: !!python/object/apply:os.system ['true']\n",
            "tag 'tag:yaml.org,2002:python/object/apply:os.system'",
        ),
    ],
)
def test_tags_that_construct_objects_are_refused(text: str, expected: str) -> None:
    [problem] = _problems(text)
    assert expected in problem.message
    assert problem.line == 1


def test_a_standard_scalar_tag_is_only_a_type() -> None:
    assert load_yaml("a: !!str 5\n", "f.yaml").data == {"a": "5"}


@pytest.mark.parametrize(
    ("text", "line", "expected"),
    [
        ("", 1, "file is empty"),
        ("# only a comment\n", 1, "file is empty"),
        ("a: [1, 2\n", 2, "invalid YAML"),
        ("a: 1\n---\nb: 2\n", 2, "another document"),
        ("a: 1\n 1: x\n", 2, "invalid YAML"),
        ("a: 1\nb: \x07\n", 2, "invalid YAML"),
        ("a: 1\n? [x]\n: 1\n", 2, "mapping keys must be plain strings"),
        ("a: 1\n2: x\n", 2, "key 2 must be a string"),
    ],
)
def test_malformed_documents_are_reported_with_a_line(text: str, line: int, expected: str) -> None:
    [problem] = _problems(text)
    assert problem.file == "f.yaml"
    assert problem.line == line
    assert expected in problem.message


def test_a_non_mapping_root_loads_for_the_shape_layer_to_refuse() -> None:
    assert load_yaml("- a\n- b\n", "f.yaml").data == ["a", "b"]
