"""`dspark certs --out DIR`: a local CA and one certificate per service, for `--tls-dir`.

Writes DIR/ca.crt and DIR/ca.key (keep the key private), and for each of scheduler, verifier and drafter
DIR/<service>/{ca.crt,tls.crt,tls.key} (the layout of a cert-manager Secret). Every certificate is valid
for the DNS name the services check (`dspark`), localhost, 127.0.0.1 and any `--san` given, for both
server and client authentication; its common name `dspark-<service>` is the caller identity verifiers
and drafters key requests by. Uses the `openssl` command (EC P-256 keys).
"""

from __future__ import annotations

import ipaddress
import shutil
import subprocess
import tempfile
from pathlib import Path

from dspark_core.errors import InvalidArgument

SERVICES = ("scheduler", "verifier", "drafter")


def add_parser(sub) -> None:
    p = sub.add_parser("certs", help="make a local CA and TLS certificates for the services",
                       description="Make a local CA and a certificate per service (for --tls-dir).")
    p.add_argument("--out", required=True, help="directory to write (created; existing files are kept unless --force)")
    p.add_argument("--san", action="append", default=[],
                   help="extra DNS name or IP address the certificates are valid for (repeatable)")
    p.add_argument("--days", type=int, default=365, help="validity in days (default 365)")
    p.add_argument("--force", action="store_true", help="overwrite existing files")
    p.set_defaults(func=run)


def _openssl(*args: str, cwd: Path) -> None:
    res = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True)
    if res.returncode != 0:
        raise InvalidArgument("openssl", " ".join(args[:2]), f"failed: {res.stderr.strip().splitlines()[-1:]}")


def _san(names: list[str]) -> str:
    out = []
    for n in ["dspark", "localhost", "127.0.0.1", *names]:
        try:
            ipaddress.ip_address(n)
            out.append(f"IP:{n}")
        except ValueError:
            out.append(f"DNS:{n}")
    return ",".join(dict.fromkeys(out))


def make_certs(out: Path, sans: list[str] = (), days: int = 365, force: bool = False) -> list[Path]:
    """Write the CA and the per-service certificates under `out`; returns the service directories."""
    if shutil.which("openssl") is None:
        raise InvalidArgument("openssl", None, "must be installed (the `openssl` command makes the certificates)")
    if days < 1:
        raise InvalidArgument("days", days, "must be >= 1")
    out = Path(out)
    if (out / "ca.key").exists() and not force:
        raise InvalidArgument("out", str(out), "already holds a CA (ca.key); pass --force to replace it")
    out.mkdir(parents=True, exist_ok=True)
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", str(days),
             "-subj", "/CN=dspark-ca", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=out)
    (out / "ca.key").chmod(0o600)
    dirs = []
    with tempfile.TemporaryDirectory() as tmp:
        ext = Path(tmp) / "ext.cnf"
        ext.write_text(f"subjectAltName={_san(list(sans))}\nbasicConstraints=CA:FALSE\n"
                       "keyUsage=critical,digitalSignature,keyEncipherment\n"
                       "extendedKeyUsage=serverAuth,clientAuth\n")
        for name in SERVICES:
            d = out / name
            d.mkdir(exist_ok=True)
            csr = Path(tmp) / f"{name}.csr"
            _openssl("req", *ec, "-keyout", str(d / "tls.key"), "-out", str(csr), "-subj", f"/CN=dspark-{name}",
                     cwd=out)
            _openssl("x509", "-req", "-in", str(csr), "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                     "-days", str(days), "-out", str(d / "tls.crt"), "-extfile", str(ext), cwd=out)
            (d / "tls.key").chmod(0o600)
            shutil.copyfile(out / "ca.crt", d / "ca.crt")
            dirs.append(d)
    (out / "ca.srl").unlink(missing_ok=True)
    return dirs


def run(args) -> int:
    dirs = make_certs(Path(args.out), args.san, args.days, args.force)
    print(f"CA: {Path(args.out) / 'ca.crt'} (its key ca.key signs more; keep it private)")
    for d in dirs:
        print(f"--tls-dir {d}")
    return 0
