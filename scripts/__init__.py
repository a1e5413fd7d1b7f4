"""The tools users run (`python scripts/<name>.py`). A package so that the tests import them by
name, `from scripts import generate`, with the repository root on the path (pytest.ini); a script
run on its own never imports this file."""
