#!/usr/bin/env bash
# Install the Debian packages the integration tests need: PostgreSQL (the Postgres
# sink) and RabbitMQ (the RabbitMQ source and sink), which the tests start throwaway
# servers from, and Chromium, the headless browser that tests the status page
# (Playwright drives /usr/bin/chromium; it downloads no browser of its own), and
# iso-codes, real JSON records the schema-evolution test reads.
# Nothing is started or enabled here: the test fixtures start their own servers
# on 127.0.0.1 with free ports and private data directories.
set -euo pipefail
want=()
ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || want+=(postgresql)
[ -x /usr/lib/rabbitmq/bin/rabbitmq-server ] || want+=(rabbitmq-server)
[ -x /usr/bin/chromium ] || want+=(chromium)
# real data for the schema-evolution test (ISO 639-3: 7,910 records, sparse fields)
[ -f /usr/share/iso-codes/json/iso_639-3.json ] || want+=(iso-codes)
if [ ${#want[@]} -eq 0 ]; then
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "install-services: need root to apt-get install ${want[*]} (or install them first)" >&2
  exit 1
fi
echo "install-services: installing ${want[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null
apt-get install -y -qq --no-install-recommends "${want[@]}" >/dev/null
