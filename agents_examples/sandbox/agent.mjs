// An agent that is neither Python nor on Ray, driving one RL session over HTTP (Node >= 18).
//
// The contract (README, "Agents outside Python or Ray"):
//   1. POST {PROXIMA_URL}/rl/sessions  (admin token)  -> {session_id, api_key, base_url}
//      base_url is the proxy's PROXIMA_PUBLIC_BASE_URL: the address sandboxes reach it at.
//   2. Any OpenAI / Anthropic client at base_url with api_key (every turn is recorded).
//   3. POST {root}/rl/sessions/{id}/reward {reward}     (session key; root = base_url minus /v1)
//   4. POST {root}/rl/sessions/{id}/finish {status}     (session key; "finished" or "failed")
//
// Step 1 is skipped when an orchestrator already created the session and handed this sandbox
// PROXIMA_SESSION_ID, PROXIMA_API_KEY and PROXIMA_BASE_URL (the sandbox then holds no admin token).
//
//   PROXIMA_URL=http://proxy:8000 PROXIMA_ADMIN_TOKEN=... PROXIMA_MODEL=policy node agent.mjs "2 + 2?"
// Prints {"session_id", "reward", "status"} as JSON; exits 1 when the run failed.

const env = process.env;

async function call(url, key, body) {
  const resp = await fetch(url, {
    method: "POST",
    headers: { authorization: `Bearer ${key}`, "content-type": "application/json" },
    body: JSON.stringify(body),
  });
  const text = await resp.text();
  if (!resp.ok) throw new Error(`POST ${url} answered ${resp.status}: ${text}`);
  return JSON.parse(text);
}

async function openSession() {
  if (env.PROXIMA_SESSION_ID && env.PROXIMA_API_KEY && env.PROXIMA_BASE_URL) {
    return {
      session_id: env.PROXIMA_SESSION_ID,
      api_key: env.PROXIMA_API_KEY,
      base_url: env.PROXIMA_BASE_URL,
    };
  }
  const root = env.PROXIMA_URL.replace(/\/+$/, "");
  return call(`${root}/rl/sessions`, env.PROXIMA_ADMIN_TOKEN, {
    group_id: env.PROXIMA_GROUP_ID || undefined,
    data_id: env.PROXIMA_DATA_ID || undefined,
    metadata: { agent: "agent.mjs" },
  });
}

const session = await openSession();
const v1 = session.base_url.replace(/\/+$/, "");
const root = v1.replace(/\/v1$/, "");
let status = "failed";
let reward = null;
try {
  const question = process.argv[2] || "What is 2 + 2?";
  const reply = await call(`${v1}/chat/completions`, session.api_key, {
    model: env.PROXIMA_MODEL,
    messages: [{ role: "user", content: question }],
    max_tokens: Number(env.PROXIMA_MAX_TOKENS || 16),
  });
  // The task's own scoring; here: 1 if the model stopped by itself, else 0.5.
  reward = reply.choices[0].finish_reason === "stop" ? 1 : 0.5;
  await call(`${root}/rl/sessions/${session.session_id}/reward`, session.api_key, { reward });
  status = "finished";
} catch (err) {
  console.error(`agent failed: ${err.message}`);
  process.exitCode = 1;
}
// Always finish: a failed session is never trained on and frees its place at once.
await call(`${root}/rl/sessions/${session.session_id}/finish`, session.api_key, { status });
console.log(JSON.stringify({ session_id: session.session_id, reward, status }));
