-- wrk script for benchmarks/serving.py: single-row predict requests back to back, cycling through the
-- JSON bodies in the file named by WRK_BODIES (one per line); at the end one JSON line with the figures
-- (latencies in microseconds; errors as wrk counts them: connect, read, write, timeout, non-2xx status).
local bodies, i = {}, 0

function init(args)
  for line in io.lines(os.getenv("WRK_BODIES")) do bodies[#bodies + 1] = line end
  wrk.method = "POST"
  wrk.headers["Content-Type"] = "application/json"
end

function request()
  i = i % #bodies + 1
  return wrk.format(nil, nil, nil, bodies[i])
end

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '{"requests": %d, "duration_us": %d, "p50_us": %d, "p99_us": %d, "errors": %d}\n',
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(99),
    e.connect + e.read + e.write + e.timeout + e.status))
end
