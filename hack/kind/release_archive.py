"""Rewrite a `docker save` archive of several images so `kind build node-image --type file` loads all
of them from the release's kube-proxy.tar instead of fetching them from a registry (build.sh).

kind (pkg/build/nodeimage) reads the tags of whichever of `repositories` and `manifest.json` comes
first in the tar, and of `manifest.json` only the first image; docker writes docker.io names short
(`kindest/kindnetd`), kind looks them up in full (`docker.io/kindest/kindnetd`). So: `repositories`
first, every name in full.
  python3 release_archive.py IN.tar OUT.tar
"""

import io
import json
import sys
import tarfile


def full(name: str) -> str:
    first = name.split("/")[0]
    if "/" not in name:
        return "docker.io/library/" + name
    if "." in first or ":" in first or first == "localhost":
        return name
    return "docker.io/" + name


def main(src_path: str, dst_path: str) -> None:
    with tarfile.open(src_path) as src, tarfile.open(dst_path, "w") as dst:
        members = sorted(src.getmembers(), key=lambda m: {"repositories": 0, "manifest.json": 1}.get(m.name, 2))
        for m in members:
            data = src.extractfile(m).read() if m.isfile() else None
            if m.name == "manifest.json":
                doc = json.loads(data)
                for entry in doc:
                    entry["RepoTags"] = [full(t) for t in entry.get("RepoTags") or []]
                data = json.dumps(doc).encode()
            elif m.name == "repositories":
                data = json.dumps({full(k): v for k, v in json.loads(data).items()}).encode()
            if data is None:
                dst.addfile(m)
            else:
                m.size = len(data)
                dst.addfile(m, io.BytesIO(data))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
