#!/bin/sh
# The sandbox side of the HTTP contract with nothing but curl: the orchestrator created the
# session (admin token) and handed this sandbox its PROXIMA_BASE_URL, PROXIMA_API_KEY and
# PROXIMA_SESSION_ID. One turn, a reward, finish. Exit status non-zero on any HTTP error.
set -eu
: "${PROXIMA_BASE_URL:?}" "${PROXIMA_API_KEY:?}" "${PROXIMA_SESSION_ID:?}" "${PROXIMA_MODEL:?}"
v1=${PROXIMA_BASE_URL%/}
root=${v1%/v1}
post() {
	curl -fsS -X POST "$1" -H "Authorization: Bearer $PROXIMA_API_KEY" \
		-H "Content-Type: application/json" -d "$2"
}
post "$v1/chat/completions" \
	"{\"model\": \"$PROXIMA_MODEL\", \"max_tokens\": 8, \"messages\": [{\"role\": \"user\", \"content\": \"Say hi.\"}]}" >/dev/null
post "$root/rl/sessions/$PROXIMA_SESSION_ID/reward" '{"reward": 0.25}' >/dev/null
post "$root/rl/sessions/$PROXIMA_SESSION_ID/finish" '{"status": "finished"}' >/dev/null
echo "$PROXIMA_SESSION_ID"
