"""The docs site's configuration reference (docs/configuration/settings.md), rendered from the one
table of settings, `extproc/settings_table.py`, so that the page cannot drift from what the service
reads: every row's variable, default, allowed values and engines-file key come from the table.

`make generate` writes the page; tests/unit/test_generated_fresh.py fails when it is stale. A new
setting needs nothing here: its row's one-line help is its meaning. `NOTES` adds what a reader
needs beyond that line (why a default, where a figure was measured, a link into the concepts).
"""

from __future__ import annotations

from pathlib import Path

from extproc.settings_table import SETTINGS, Setting

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "configuration" / "settings.md"

#: What a setting with structure (not an int, float, bool or choice) accepts, by kind; `ACCEPTS`
#: overrides it for one setting.
KIND_ACCEPTS = {
    "url": "http(s) URL",
    "listen": "HOST:PORT; `:PORT` = `127.0.0.1:PORT`",
    "list": "comma-separated names",
    "file": "a YAML file",
    "text": "text",
}
ACCEPTS = {
    "ADMISSION_TOKENIZER": "`qwen3`, `qwen2.5`, `llama3` or a `.json` path",
    "ADMISSION_GATED_PATHS": "comma-separated plain paths",
    "ADMISSION_PASS_PATHS": "comma-separated plain paths, `*` = one segment",
    "ADMISSION_REDIS_URL": "`redis://`, `rediss://` or `unix://` URL",
    "ADMISSION_LEDGER_KEY_PREFIX": "1-64 of `A-Za-z0-9_.:-`",
    "ADMISSION_REPLICA_ID": "1-128 of `A-Za-z0-9_.:-`",
    "EXTPROC_TLS_CERT": "a PEM file; the three `EXTPROC_TLS_*` or none",
    "EXTPROC_TLS_KEY": "a PEM file; the three `EXTPROC_TLS_*` or none",
    "EXTPROC_TLS_CLIENT_CA": "a PEM file; the three `EXTPROC_TLS_*` or none",
}

#: The docs' words beyond the row's help line, appended to it (after `; `) in the meaning column.
NOTES = {
    "ADMISSION_OBSERVE_MODELS": "plus what the engine serves: \"Models\" in [the gate](../concepts/gate.md)",
    "ADMISSION_ENGINE_DIALECT": "see [Engine metrics dialects](dialects.md); the default of every "
                                "engine's `dialect`",
    "EXTPROC_CONFIG": "see [the engines file](engines-file.md); excludes `ADMISSION_OBSERVE_MODELS`",
    "ADMISSION_MAX_PARK_SECONDS": "measured reason: [Benchmarks](../benchmarks.md#defaults)",
    "ENGINE_POLL_INTERVAL_SECONDS": "also the poll timeout",
    "ADMISSION_SCRAPE_GRACE_SECONDS": "see \"Between-poll accounting\" in [the gate](../concepts/gate.md)",
    "ADMISSION_ENGINE_DONE_AFTER_SECONDS": "see \"Engine done, stream open\" in [the gate](../concepts/gate.md)",
    "ADMISSION_KV_BUDGET": "needs local accounting; see [the KV budget](../concepts/kv-budget.md)",
    "ADMISSION_ESTIMATE": "see [the token estimate](../concepts/estimate.md); with `bytes`, set "
                          "`ADMISSION_BYTES_PER_TOKEN=4` too for the old default",
    "ADMISSION_TOKENIZER": "a `tokenizer.json` (Hugging Face `tokenizers`) or a built-in vocabulary; "
                           "counts every chat/completion prompt exactly, in a worker thread",
    "ADMISSION_TOKENIZE_ABOVE_BYTES": "without a tokenizer; chat and completion requests only "
                                      "([the token estimate](../concepts/estimate.md))",
    "ADMISSION_BYTES_PER_TOKEN": "safe for JSON and CJK on the tokenizers measured; prose is ~4.7",
    "ADMISSION_LEARN_BYTES_PER_TOKEN": "turn off where other gateways' traffic reaches the engine too "
                                       "(it then reads low and over-reserves)",
    "ADMISSION_TEMPLATE_TOKENS_FIXED": "measured: Qwen3 3, Llama-3.1 30",
    "ADMISSION_TEMPLATE_TOKENS_PER_MESSAGE": "measured: Qwen3 and Llama-3.1 5",
    "ADMISSION_TEMPLATE_TOKENS_TOOLS": "measured: Qwen3 and Llama-3.1 ~80",
    "ADMISSION_WAIT_PREDICTION": "see \"Waits from work\" in [the KV budget](../concepts/kv-budget.md)",
    "ADMISSION_GATED_PATHS": "see \"Paths\" in [the gate](../concepts/gate.md)",
    "ADMISSION_PASS_PATHS": "none may be a gated path; see \"Paths\" in [the gate](../concepts/gate.md)",
    "ADMISSION_GENERATION_RESERVATION": "from `vllm:request_generation_tokens`; measured in "
                                        "[Benchmarks](../benchmarks.md)",
    "ADMISSION_LEDGER": "see [Deployment shapes](../deployment/shapes.md) and [the ledger](../ledger.md)",
    "ADMISSION_LEDGER_LEASE_SECONDS": "renewed every third of it; the chart's floor is 0.5",
    "ADMISSION_REPLICA_ID": "the chart sets the pod name; must be unique",
    "EXTPROC_LISTEN": "ext_proc + grpc.health.v1; whoever reaches this port can open ext_proc streams and "
                      "hold the engine's slots, so a service reached over the network should require client "
                      "certificates (`EXTPROC_TLS_*`; [who may open streams]"
                      "(../operations.md#who-may-open-streams-on-the-grpc-port))",
    "EXTPROC_ADMIN_LISTEN": "unauthenticated: keep it on loopback",
    "EXTPROC_PROBE_LISTEN": "for probes and scrapes from outside: name the host, e.g. `0.0.0.0:9004`",
    "EXTPROC_TLS_CERT": "checked at startup (readable, the key is the certificate's, the CA parses; exit 2 "
                        "naming the variable). `extproc envoy-config` then gives Envoy's `extproc` cluster a "
                        "TLS transport socket that presents the same certificate and verifies the service with "
                        "the same CA and by the host it dials (`--extproc-tls-cert/-key/-ca/-server-name` for "
                        "Envoy's own). Certificates are read at startup: restart both after a rotation",
}

HEADER = """\
# Configuration reference

<!-- Generated by `make generate` (scripts/settings_page.py) from extproc/settings_table.py; do not edit. -->

Environment variables, read and validated once at startup (`extproc --help` prints this table;
`extproc check-config` prints the effective configuration as JSON; `extproc serve` logs it at
start-up as one INFO line per group (`configuration: listen`, `polling`, `admission`, `estimate`,
`ledger`, ..., one per engine) and as one JSON document at DEBUG). A bad value exits with
status 2 and a message naming the variable and the value. The `accepts` column is what that
check allows (`extproc/settings_table.py` holds it, and the parsing reads it from there); a
setting marked *per engine* may also be set in an engine's entry of
[the engines file](engines-file.md) under that key.

| variable | default | accepts | meaning |
|---|---|---|---|
"""

FOOTER = """
`/readyz` is deliberately not tied to engine health: a metrics outage makes admission fail open;
it must not take the gateway out of service.

Any of these can be set for the local stack the same way: `ADMISSION_MAX_PARK_SECONDS=30 make run`.
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def row(setting: Setting) -> str:
    """One table row: the variable, its default, what it accepts (and its engines-file key), its meaning."""
    if setting.default is None:
        default = "unset"
    elif setting.literal:
        default = f"`{setting.default}`"
    else:
        default = setting.default
    accepts = setting.allowed or ACCEPTS.get(setting.env) or KIND_ACCEPTS[setting.kind]
    if setting.engine_key is not None:
        accepts += f"; per engine: `{setting.engine_key}`"
    meaning = "; ".join([setting.help, *([NOTES[setting.env]] if setting.env in NOTES else [])])
    return f"| `{setting.env}` | {_cell(default)} | {_cell(accepts)} | {_cell(meaning)} |\n"


def render() -> str:
    """The whole page."""
    return HEADER + "".join(row(s) for s in SETTINGS) + FOOTER


def outputs() -> dict[Path, bytes]:
    """What `make generate` writes."""
    return {PAGE: render().encode()}
