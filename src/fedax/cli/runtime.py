"""``fedax server init|start|status`` and ``fedax client``: the networked runtime's commands
(docs/deployment.md). JAX and grpc load only when a command runs, so ``fedax --version``
stays light."""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import os
import secrets
import shutil
import sys
from pathlib import Path
from typing import Any, overload

from fedax.io import finite_json, json_text, write_atomic
from fedax.spec.errors import CommandError, ConfigError


def _one_line(command):
    """A bad setting or a refused token ends the command with one line naming the fix
    (``fedax: error: ...``, status 2), a server that cannot be reached with ``fedax: error:
    cannot connect to HOST:PORT: <cause>; <what to do>`` (status 1), a server address that
    cannot be listened on (a port in use) with ``fedax: error: cannot listen on HOST:PORT:
    <cause>; <what to do>`` (status 2), not a traceback."""

    @functools.wraps(command)
    def wrapped(args) -> int:
        try:
            return command(args)
        except ConnectionError as err:
            raise CommandError(str(err)) from err
        except (ValueError, PermissionError) as err:  # (PermissionError is an OSError)
            if isinstance(err, ConfigError):
                raise
            raise ConfigError(str(err)) from err
        except OSError as err:
            server = sys.modules.get("fedax.runtime.server")  # not loaded: not its error
            if server is not None and isinstance(err, server.CannotListen):
                raise ConfigError(str(err)) from err
            raise

    return wrapped


def _quiet_grpc(args) -> None:
    """gRPC's C core logs a failed TLS handshake (and more) on stderr at INFO unless told
    otherwise; the commands report such failures themselves, in one line. Must run before
    grpc is imported; ``GRPC_VERBOSITY`` set by the user, or ``--debug``, wins."""
    if not getattr(args, "debug", False):
        os.environ.setdefault("GRPC_VERBOSITY", "ERROR")


class _Stderr(logging.StreamHandler):
    """A handler on whatever ``sys.stderr`` is when a record is written (a command run
    in-process, as the tests do, must not keep a stream that is closed later)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        del value


def _logging(name: str) -> None:
    handler = _Stderr()
    handler.setFormatter(logging.Formatter(f"fedax {name}: %(asctime)s %(message)s",
                                           "%H:%M:%S"))
    root = logging.getLogger("fedax.runtime")
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)


def _data_file(path: str | Path):
    import numpy as np

    try:
        with np.load(path, allow_pickle=False) as data:
            return data["x"], data["y"]
    except (OSError, KeyError, ValueError) as err:
        raise ValueError(f"cannot read client data {str(path)!r} ({err}); expected an .npz "
                         "with arrays x and y (fedax server init writes examples)") from None


@contextlib.contextmanager
def _staged(out: Path, overwrite: bool):
    """Yields an empty directory to write a setup into: beside ``out``, or inside it if
    it exists. When the block succeeds its files move into ``out`` (created if missing:
    one rename); when anything fails (an exception, Ctrl-C) the directory is removed, with
    any parent directories this made, so ``out`` is exactly as before. Files already in
    ``out`` are replaced only with ``overwrite``, and only at the end; nothing else in
    ``out`` is touched."""
    target = Path(os.path.abspath(out))
    parent = target if target.is_dir() else target.parent
    made = [p for p in (parent, *parent.parents) if not p.exists()]
    stage = None
    try:
        parent.mkdir(parents=True, exist_ok=True)
        stage = parent / f".{target.name}.fedax-init-{secrets.token_hex(4)}"
        stage.mkdir()
        yield stage
        _move_into(stage, out, overwrite)
    except BaseException:
        if stage is not None:
            shutil.rmtree(stage, ignore_errors=True)
        for p in made:  # deepest first; each only if empty
            with contextlib.suppress(OSError):
                p.rmdir()
        raise


def _move_into(stage: Path, out: Path, overwrite: bool) -> None:
    """Moves ``stage``'s files into ``out`` (``registry.json``, which marks a setup, last);
    checks every target first, so a refusal moves nothing."""
    if not out.exists():
        stage.rename(out)
        return
    if not out.is_dir():
        raise ValueError(f"{out} is a file; name a directory for the setup")
    files = sorted((p for p in stage.rglob("*") if not p.is_dir()),
                   key=lambda p: (p.name == "registry.json", str(p)))
    for src in files:
        dst = out / src.relative_to(stage)
        for above in reversed(dst.relative_to(out).parents[:-1]):
            if (out / above).exists() and not (out / above).is_dir():
                raise ValueError(f"{out / above} is a file, where the setup needs a "
                                 "directory; move it away")
        if dst.is_dir() or (dst.exists() and not overwrite):
            raise ValueError(f"{out} already holds {dst.relative_to(out)}; pass --overwrite "
                             "to replace it, or choose another directory")
    for src in files:
        dst = out / src.relative_to(stage)
        dst.parent.mkdir(parents=True, exist_ok=True)
        os.replace(src, dst)
    shutil.rmtree(stage)


# ``fedax server init`` without --config: Synthetic(1, 1) (60 features, 10 classes) with
# the logistic model, every client every round.
DEFAULT_CONFIG = {"seed": 0, "rounds": 5, "dataset": "synthetic",
                  "model": "logistic", "algorithm": "fedavg", "client_fraction": 1.0,
                  "local_epochs": 1, "batch_size": 10, "client_lr": 0.05, "eval_every": 1}


def _config_text(config, source: str) -> str:
    """The setup's ``config.yaml``: the config as YAML, headed by where it came from."""
    import yaml

    from fedax.spec.config import config_to_dict

    return f"# fedax server init from {source}\n" + yaml.safe_dump(config_to_dict(config),
                                                                   sort_keys=False)


@_one_line
def cmd_server_init(args) -> int:
    """An experiment config for ``execution.mode: network`` (``--config``, or a small
    synthetic one) with ``network.setup: DIR``, and for its N clients a CA, a server
    certificate, tokens and the registry; written beside DIR and moved into it only when all
    of them are made. Clients hold their own data (``fedax client --config``)."""
    from fedax.builder.datasets import build_data
    from fedax.cli.run_dirs import resolve_config
    from fedax.runtime import make_dev_pki
    from fedax.runtime.launch import network_task
    from fedax.spec.config import load_config, validate_config, with_overrides

    out = Path(args.dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} is a file; name a directory for the setup")
    if (out / "registry.json").exists() and not args.overwrite:
        raise ValueError(f"{out} already holds a setup; pass --overwrite to replace it")
    target = Path(os.path.abspath(out))
    sets = [*([f"num_clients={args.clients}"] if args.clients else []), *args.set,
            "execution.mode=network", f"network.setup={target}", "network.local_clients=0"]
    if args.config is not None:
        config, source = load_config(resolve_config(args.config), sets), args.config
    else:
        config = validate_config(with_overrides({**DEFAULT_CONFIG, "num_clients": 4}, sets))
        source = "defaults"
    data = build_data(config)
    network_task(config, data)  # what the network cannot run is refused before anything
    hosts = [h for h in args.hosts.split(",") if h]
    n = data.train.num_clients
    with _staged(out, args.overwrite) as stage:
        make_dev_pki(stage, n, hosts)
        write_atomic(stage / "config.yaml", _config_text(config, source))
    print(f"wrote ca.pem, server.pem/.key, registry.json, tokens/0..{n - 1}.token, "
          f"identities/0..{n - 1}.key, roster.json and config.yaml in {out}; start the "
          f"server with: fedax server start --config {out}/config.yaml, and each client "
          f"with: fedax client --server HOST:PORT --ca {out}/ca.pem --config "
          f"{out}/config.yaml --id K --token-file {out}/tokens/K.token --identity "
          f"{out}/identities/K.key --roster {out}/roster.json")
    return 0


def _server_address(parser) -> None:
    """The options that say where a server is and how to trust it."""
    parser.add_argument("--server", required=True, help="host:port")
    parser.add_argument("--ca", required=True, help="CA certificate (PEM)")
    parser.add_argument("--server-name", help="host name to expect in the certificate")


def _server_config(args):
    """``--task``'s ``ServerConfig`` from the flags (unset ones: its defaults)."""
    from fedax.runtime import ServerConfig

    given = {"over_selection": args.over_selection, "deadline_s": args.deadline_s,
             "max_attempts": args.max_attempts, "max_examples": args.max_examples}
    return ServerConfig(
        rounds=args.rounds, cohort_size=args.cohort_size, min_reports=args.min_reports,
        min_clients=args.min_clients, poll_interval_s=args.poll_interval_s,
        poll_hold_s=args.poll_hold_s, liveness_s=args.liveness_s,
        max_message_bytes=int(args.max_message_mb * (1 << 20)),
        chunk_bytes=int(args.chunk_kb * 1024), checkpoint_dir=args.checkpoint_dir,
        keep_checkpoints=args.keep_checkpoints,
        **{k: v for k, v in given.items() if v is not None})


def _start_from_config(args) -> int:
    """``fedax server start --config CONFIG``: the config's network run, serving the
    clients that connect (no local ones), outputs in ``--out``."""
    from fedax.cli.run_dirs import resolve_config
    from fedax.experiments.network import run_network
    from fedax.spec.config import load_config

    given = [f"--{n.replace('_', '-')}" for n in ("rounds", "cohort_size", "over_selection",
                                                   "min_reports", "deadline_s",
                                                   "max_attempts", "max_examples",
                                                   "checkpoint_dir", "test_data", "cert",
                                                   "key", "registry", "roster")
             if getattr(args, n) is not None]
    if given:
        raise ValueError(f"with --config, {', '.join(given)} come from the config (rounds, "
                         "the network: section, network.setup); set them with --set, e.g. "
                         "--set network.cohort_size=10")
    config = load_config(resolve_config(args.config), [*args.set, "execution.mode=network",
                                       "network.local_clients=0",
                                       f"network.host={args.host}",
                                       f"network.port={args.port}"])
    out = Path(args.out or "runs/server")
    options = {"poll_interval_s": args.poll_interval_s,
               "poll_hold_s": args.poll_hold_s, "liveness_s": args.liveness_s,
               "max_message_bytes": int(args.max_message_mb * (1 << 20)),
               "chunk_bytes": int(args.chunk_kb * 1024),
               "keep_checkpoints": args.keep_checkpoints,
               **({} if args.min_clients is None else {"min_clients": args.min_clients})}
    summary = run_network(config, out, resume=args.resume, server_options=options)
    shown = {k: summary[k] for k in ("status", "rounds_run", "final_test_accuracy")}
    print(json_text(finite_json(shown)[0], indent=1))  # strict JSON: a NaN is null
    return 0


@_one_line
def cmd_server_start(args) -> int:
    import time

    _quiet_grpc(args)
    from fedax.runtime import Registry, Server, ServerTLS, Task
    from fedax.runtime.secagg import Roster

    _logging("server")
    if args.config is not None:
        if args.task is not None:
            raise ValueError("give the run as one of --config (an experiment config) and "
                             "--task (a hand-built task.json)")
        return _start_from_config(args)
    missing = [f"--{n}" for n in ("task", "cert", "key", "registry", "rounds", "cohort_size")
               if getattr(args, n) is None]
    if missing:
        raise ValueError(f"without --config, fedax server start needs {', '.join(missing)}")
    try:
        task = Task.from_json(Path(args.task).read_text())
    except OSError as err:
        raise ValueError(f"cannot read the task {args.task!r} ({err.strerror}); pass the "
                         "task.json fedax server init wrote") from None
    evaluate = None
    if args.test_data:
        x, y = _data_file(args.test_data)
        evaluate = _evaluator(task, x, y)
    server = Server(task, _server_config(args), ServerTLS(args.cert, args.key),
                    Registry.load(args.registry), address=f"{args.host}:{args.port}",
                    resume=args.resume, evaluate=evaluate,
                    roster=None if args.roster is None else Roster.load(args.roster))
    port = server.start()
    print(f"fedax server: listening on {args.host}:{port} (TLS)", file=sys.stderr, flush=True)
    try:
        server.wait()
        time.sleep(args.linger_s)  # let polling clients hear "done"
    finally:
        server.stop()
    print(f"fedax server: {server.rounds_done} rounds done", file=sys.stderr)
    return 0


def _evaluator(task, x, y):
    import jax
    import jax.numpy as jnp

    from fedax.models import get_model

    model = get_model(task.model, **task.model_options)
    x, y = jnp.asarray(x), jnp.asarray(y)

    @jax.jit
    def accuracy(params):
        return jnp.mean(jnp.argmax(model.apply(params, x), -1) == y)

    return lambda params: {"test_accuracy": float(accuracy(params))}


@_one_line
def cmd_server_status(args) -> int:
    _quiet_grpc(args)
    from fedax.runtime import ClientTLS, server_status

    status = server_status(args.server, ClientTLS(args.ca, args.server_name),
                           timeout_s=args.timeout_s)
    print(json_text(finite_json(status)[0], indent=1))
    return 0


def _ids(text: str) -> list[int]:
    """``--id``: ``K``, ``A-B`` (inclusive) or a comma list of either."""
    ids: list[int] = []
    try:
        for part in text.split(","):
            first, _, last = part.strip().partition("-")
            ids += range(int(first), int(last or first) + 1)
    except ValueError:
        raise ValueError(f"--id {text!r} is not a client id, a range A-B or a comma list of "
                         "them") from None
    if not ids or min(ids) < 0 or len(set(ids)) != len(ids):
        raise ValueError(f"--id {text!r} names no client, a negative id or one id twice")
    return ids


@overload
def _per_client(template: str, k: int, several: bool, option: str) -> str: ...
@overload
def _per_client(template: None, k: int, several: bool, option: str) -> None: ...
def _per_client(template: str | None, k: int, several: bool, option: str) -> str | None:
    if template is None:
        return None
    if several and "{id}" not in template:
        raise ValueError(f"{option} must contain {{id}} when --id names several clients "
                         "(each keeps its own)")
    return template.replace("{id}", str(k))


@_one_line
def cmd_client(args) -> int:
    """One client, or several (``--id A-B``: one thread each in this process), on its own
    data: an ``.npz`` (``--data``) or its partition of an experiment config
    (``--config``, as ``fedax run`` deals it)."""
    import threading

    _quiet_grpc(args)
    from fedax.runtime import Client, ClientConfig, ClientTLS, read_token

    ids = _ids(args.id)
    several = len(ids) > 1
    _logging(f"client {args.id}")
    if (args.data is None) == (args.config is None):
        raise ValueError("give the client's data as exactly one of --data FILE.npz and "
                         "--config CONFIG (its partition of the experiment's data set)")
    if args.config is not None:
        from fedax.runtime.launch import client_examples
        from fedax.spec.config import load_config

        examples = client_examples(load_config(args.config), ids)
    else:
        examples = {k: (*_data_file(_per_client(args.data, k, several, "--data")), None)
                    for k in ids}
    roster = _roster(args)
    clients = [Client(ClientConfig(args.server, k, read_token(
        _per_client(args.token_file, k, several, "--token-file")),
        ClientTLS(args.ca, args.server_name),
        state_dir=_per_client(args.state_dir, k, several, "--state-dir"),
        reconnect_s=args.reconnect_s, connect_s=args.connect_s, delay_s=args.delay_s,
        identity=roster and _identity(args, k, several, roster), roster=roster),
        *examples[k][:2], test=examples[k][2]) for k in ids]
    results: dict[int, Any] = {}

    def go(k, client):
        try:
            results[k] = client.run()
        except BaseException as err:  # reported below, one line per client
            results[k] = err

    threads = [threading.Thread(target=go, args=(k, c), daemon=True)
               for k, c in zip(ids, clients, strict=True)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    failed = {k: r for k, r in results.items() if isinstance(r, BaseException)}
    for k in ids:
        if k in failed:
            continue
        accepted = sum(1 for r in results[k] if r[2])
        print(f"fedax client {k}: done; {accepted} of {len(results[k])} reports accepted",
              file=sys.stderr)
    if failed:
        k, err = sorted(failed.items())[0]
        if not isinstance(err, Exception):
            raise err
        raise err if not several else type(err)(f"client {k}: {err}")
    return 0


def _roster(args):
    """``--roster`` (with ``--identity``, both or neither), loaded; None without."""
    if (args.identity is None) != (args.roster is None):
        raise ValueError("give --identity (this client's key) and --roster (every client's "
                         "verification key) together, or neither")
    if args.roster is None:
        return None
    from fedax.runtime.secagg import Roster

    return Roster.load(args.roster)


def _identity(args, k: int, several: bool, roster):
    """Client ``k``'s identity key, checked against its roster entry."""
    from fedax.runtime.secagg import IdentityKey

    path = _per_client(args.identity, k, several, "--identity")
    identity = IdentityKey.load(path)
    if roster.keys.get(k) != identity.public:
        raise ValueError(f"the identity key {path} is not client {k}'s in the roster "
                         f"{args.roster}")
    return identity


@_one_line
def cmd_identity(args) -> int:
    """A new SecAgg+ identity key in PATH (never overwritten); prints the roster line."""
    from fedax.runtime.secagg import IdentityKey

    if Path(args.path).exists():
        raise ValueError(f"{args.path} exists; an identity key is never overwritten (it is "
                         "this client's name in the roster)")
    identity = IdentityKey.generate()
    identity.save(args.path)
    print(f'"{args.id}": "{identity.public.hex()}"')
    print(f"wrote {args.path}; give the line above to the operator for roster.json "
          '({"ed25519": {...}})', file=sys.stderr)
    return 0


def add_commands(sub, common: argparse.ArgumentParser) -> None:
    """Adds ``server`` (init, start, status) and ``client`` to the ``fedax`` parser."""
    server = sub.add_parser("server", help="the networked runtime's server (TLS, tokens)",
                            parents=[common])
    server_sub = server.add_subparsers(dest="server_command", required=True)
    init = server_sub.add_parser(
        "init", parents=[common],
        help="a setup in DIR: config.yaml (execution.mode network), a CA and server "
             "certificate, a token per client and the registry (for one machine or a trial)")
    init.add_argument("dir")
    init.add_argument("--config", help="the experiment config (a bundled name or a path; "
                      "default: Synthetic(1, 1) with the logistic model)")
    init.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                      help="override a config key (repeatable), e.g. --set algorithm=fedprox")
    init.add_argument("--clients", type=int, help="the number of clients (num_clients; "
                                                  "default the config's, 4 without one)")
    init.add_argument("--hosts", default="localhost,127.0.0.1",
                      help="host names / IPs the server certificate is valid for")
    init.add_argument("--overwrite", action="store_true")
    init.set_defaults(func=cmd_server_init)

    start = server_sub.add_parser("start", parents=[common], help="run the server")
    start.add_argument("--config", help="an experiment config (fedax server init --config "
                       "writes one): its rounds, cohort, deadlines and setup; outputs in --out")
    start.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="with --config: override a config key (repeatable)")
    start.add_argument("--out", help="with --config: the run directory (default runs/server)")
    start.add_argument("--task", help="instead of --config: a hand-built task.json")
    start.add_argument("--cert", help="server certificate chain (PEM)")
    start.add_argument("--key", help="server private key (PEM)")
    start.add_argument("--registry", help="client registry (JSON)")
    start.add_argument("--roster", help="the clients' SecAgg+ identity keys (JSON): secure "
                       "rounds run the consistency check")
    start.add_argument("--host", default="127.0.0.1",
                       help="interface to listen on (0.0.0.0 for other machines)")
    start.add_argument("--port", type=int, default=9092)
    start.add_argument("--rounds", type=int)
    start.add_argument("--cohort-size", type=int,
                       help="K: accepted reports that close a round")
    start.add_argument("--over-selection", type=float,
                       help="select ceil(K*(1+f)) clients (default 0)")
    start.add_argument("--min-reports", type=int,
                       help="fewer accepted reports at the deadline retry the round "
                            "(default K)")
    start.add_argument("--min-clients", type=int,
                       help="alive clients needed to open a round (default the selection)")
    start.add_argument("--deadline-s", type=float, help="default 60")
    start.add_argument("--max-attempts", type=int, help="default 10")
    start.add_argument("--poll-interval-s", type=float, default=0.5,
                       help="how often a client whose poll is not held polls again")
    start.add_argument("--poll-hold-s", type=float, default=20.0,
                       help="hold an idle client's poll open this long, waiting for its "
                            "task (long poll; 0: answer at once)")
    start.add_argument("--liveness-s", type=float, default=30.0,
                       help="a client that has not polled for this long (and whose poll is "
                            "not held) is not selected")
    start.add_argument("--max-message-mb", type=float, default=256.0)
    start.add_argument("--chunk-kb", type=float, default=1024.0,
                       help="largest piece of a streamed message, 1 to 65536 (a client may "
                            "ask for smaller ones)")
    start.add_argument("--max-examples", type=int,
                       help="the most examples (n_k) a client's report may claim; a larger "
                            "claim is refused (default 1000000)")
    start.add_argument("--keep-checkpoints", type=int, default=3,
                       help="checkpoints kept (the newest and the ones before it)")
    start.add_argument("--checkpoint-dir", help="checkpoint after every round, rounds.jsonl")
    start.add_argument("--resume", action="store_true",
                       help="continue from the checkpoint in --checkpoint-dir")
    start.add_argument("--test-data", help="an .npz (x, y) to evaluate after every round")
    start.add_argument("--linger-s", type=float, default=2.0,
                       help="after the last round, keep serving this long so clients hear "
                            "'done' (default 2)")
    start.set_defaults(func=cmd_server_start)

    status = server_sub.add_parser("status", parents=[common],
                                   help="a running server's state (health check)")
    _server_address(status)
    status.add_argument("--timeout-s", type=float, default=5.0)
    status.set_defaults(func=cmd_server_status)

    client = sub.add_parser("client", parents=[common],
                            help="a networked runtime client on its own data")
    _server_address(client)
    client.add_argument("--id", required=True,
                        help="this client's id; or A-B (a thread per client, each with its "
                             "own token file, data and state dir: put {id} in their paths)")
    client.add_argument("--token-file", required=True)
    client.add_argument("--data", help="an .npz with this client's x and y")
    client.add_argument("--config", help="instead of --data: the experiment config whose "
                                         "data set's partition this client holds")
    client.add_argument("--state-dir", help="per-client state (SCAFFOLD's c_i) lives here")
    client.add_argument("--connect-s", type=float, default=15.0,
                        help="at the start, give up when the server cannot be reached "
                             "within this long, retrying after 1, 2, 4, 4... s (default 15)")
    client.add_argument("--reconnect-s", type=float, default=60.0,
                        help="once joined, give up after the server is unreachable this "
                             "long (default 60)")
    client.add_argument("--delay-s", type=float, default=0.0,
                        help="wait this long after training each task, before reporting (a "
                             "slow device, for experiments; default 0)")
    client.add_argument("--identity", help="this client's SecAgg+ identity key (fedax "
                        "identity writes one; {id} as for --token-file): with --roster, "
                        "it takes part in secure rounds only with the consistency check")
    client.add_argument("--roster", help="every client's identity verification key (JSON, "
                        "from the operator, not the server)")
    client.set_defaults(func=cmd_client)

    identity = sub.add_parser("identity", parents=[common],
                              help="a new SecAgg+ identity key for a client (prints its "
                                   "roster entry)")
    identity.add_argument("path")
    identity.add_argument("--id", required=True, type=int, help="the client's id")
    identity.set_defaults(func=cmd_identity)
