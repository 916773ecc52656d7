import pathlib

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
SAMPLE = yaml.safe_load((ROOT / "manifests/samples/omnistage.yaml").read_text())
