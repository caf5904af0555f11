import pytest


@pytest.fixture(scope="session")
def tok():
    from dsv4.chat import load_tokenizer

    return load_tokenizer(None)
