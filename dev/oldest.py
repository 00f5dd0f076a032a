"""Print the lower bounds settings.ini declares as pip constraints (`name==version`), for `make test-oldest`.

    python dev/oldest.py > .venv-oldest.txt

Every `name>=version` of the runtime and dev requirements becomes `name==version`; a requirement with no lower bound
is left to pip. The dev requirements' own pins (nbdev, trl) stay as they are.
"""
import configparser, re
from pathlib import Path

settings = configparser.ConfigParser()
settings.read(Path(__file__).resolve().parent.parent / "settings.ini")
requirements = settings["DEFAULT"]["requirements"].split() + settings["DEFAULT"]["dev_requirements"].split()
for requirement in requirements:
    if m := re.fullmatch(r"([A-Za-z0-9_.\-]+)(\[.*\])?>=([^,<>=!]+)", requirement): print(f"{m[1]}=={m[3]}")
