"""The registry of extras (harness/extensions.py): an extra registered in-process adds its API names and fills the
core's extension points as the built-in ones do; one whose module does not load is a warning, not a failure."""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator

import pytest

import harness
from harness import events, extensions
from harness.commands import api


@pytest.fixture
def outside() -> Iterator[types.ModuleType]:
    """A module of an outside package, with an API function and a hook, registered as the extra `outside`."""
    module = types.ModuleType("outside_extra_api")
    module.__all__ = ["greet"]  # type: ignore[attr-defined]
    module.greet = lambda name: f"hello {name}"  # type: ignore[attr-defined]
    module.sign = lambda tracker, run_id, key: b"signed"  # type: ignore[attr-defined]
    sys.modules[module.__name__] = module
    before = extensions.extras()
    extensions.register(extensions.Extra("outside", api=module.__name__, names=("greet",),
                                         hooks={"outside.point": f"{module.__name__}:sign"}))
    yield module
    extensions._REGISTRY.clear()
    extensions._REGISTRY.update(before)
    del sys.modules[module.__name__]


def test_an_extra_registered_in_process_joins_the_api_and_fills_its_point(outside: types.ModuleType) -> None:
    assert harness.greet("you") == "hello you"  # type: ignore[attr-defined]
    assert api.greet is outside.greet  # type: ignore[attr-defined]
    assert "greet" in harness.__all__ and "greet" in api.__all__
    assert extensions.hook("outside.point") is outside.sign
    assert extensions.hook("no.such.point") is None  # the core goes without it


def test_the_built_in_extras_fill_the_core_s_points_and_keep_their_names() -> None:
    assert list(extensions.extras())[:len(extensions.BUILTIN)] == list(extensions.BUILTIN)
    for point in (extensions.LOCALIZE, extensions.COMPARE, extensions.SIGN, extensions.STEP_TRACER,
                  extensions.INVARIANT):
        assert callable(extensions.hook(point)), point
    assert harness.trace.__module__ == "harness.extras.trace.api"
    assert {"trace", "bisect", "verify", "attest", "verify_record", "TraceOptions"} <= set(harness.__all__)
    with pytest.raises(AttributeError, match="no attribute 'no_such_verb'"):
        harness.no_such_verb  # noqa: B018


def test_an_outside_extra_whose_module_does_not_load_is_a_warning() -> None:
    before = extensions.extras()
    extensions.register(extensions.Extra("broken", cli="no_such_package.cli", hooks={"broken.point": "no_such_package:f"}))
    said: list[events.Event] = []
    try:
        with events.listening(said.append):
            assert extensions.hook("broken.point") is None
            modules = extensions.cli_modules()
    finally:
        extensions._REGISTRY.clear()
        extensions._REGISTRY.update(before)
    assert [m.__name__ for m in modules] == [e.cli for e in before.values() if e.cli is not None]
    warned = [e.text for e in said if isinstance(e, events.Warning)]
    assert any("broken's hook broken.point (no_such_package) does not load" in w for w in warned), warned
    assert any("broken's commands (no_such_package.cli) does not load" in w for w in warned), warned
