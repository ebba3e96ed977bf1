"""The loop-failure record every supervised loop keeps: one shape, one way to say an exception."""
from llmgwctl import health


def test_a_failure_is_the_shape_status_shows():
    assert health.failure("reading the API key file", "keys.yaml: not valid YAML", 12.5) == {
        "at": 12.5, "what": "reading the API key file", "error": "keys.yaml: not valid YAML"}


def test_error_text_names_the_exception_and_is_bounded():
    assert health.error_text(KeyError("m")) == "KeyError: 'm'"
    long = health.error_text(ValueError("x" * 10_000))
    assert long.startswith("ValueError: x") and len(long) == health.MAX_ERROR
