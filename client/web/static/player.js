// The browser player: one websocket per session, which starts the world and sets up its video: over WebRTC (rtc.js:
// the world's video in the <video> element, the page's keys, events, saves and stop on a data channel), or, until it
// connects and when it fails, as JPEG messages on the websocket (the page says which). Each block arrives as a JSON
// header on the websocket; JPEG frames play on the canvas at 16 fps from a queue. The keys held now are sent whenever
// they change. The JPEG queue holds at most one block's frames and SLACK_FRAMES more: when blocks come faster than
// they play, the oldest queued frames are skipped (counted in the status), so what is on screen stays within about
// a block of the newest frame (the bridge bounds the WebRTC video's queue the same way). "Watch link" gives a link
// that anyone can open to watch the world live (read-only); "Revoke" ends it.
// The world survives its server: the bridge saves it and, when the server is lost, resumes it elsewhere (a "failover"
// message when lost, another once it goes on). "Save world" shows the saved world's id and a link that resumes it;
// a page opened with ?resume=ID starts from that saved world.
// The world survives its page's link too: the bridge gives each session a rejoin token, kept in sessionStorage; when
// the socket closes while the world plays (a drop, a reload), the page opens a new one with ?rejoin=TOKEN&keys=KEYS
// (every second, for the bridge's reconnect_s) and plays on from the next block; each rejoin brings a new token.
"use strict";
const FPS = 16;
const SLACK_FRAMES = 4;  // queued beyond the newest block's frames before the oldest are skipped (a quarter second)
const KEYS = "wasdijkl";
const $ = (id) => document.getElementById(id);
const screen = $("screen");
const ctx = screen.getContext("2d");
let ws = null;
let rtc = null;        // the WebRTC video: {pc, channel, codec}, while the page plays over it
let answered = null;   // the offer sent on the websocket, waiting for its answer: {resolve, reject}
let held = new Set();
let queue = [];        // decoding or decoded frames, oldest first: {bitmap, skipped}
let maxQueued = 0;     // the newest block's frames + SLACK_FRAMES
let stats = null;
let startedAt = 0;     // when Start was pressed (ms), for the "starting" status
let told = "";         // the bridge's first word on this session ("starting": what the server does now)
let startMessage = null;  // the session's start message, sent when the bridge opened the session
const resumeId = new URLSearchParams(location.search).get("resume");  // a saved world to start from
const REJOIN = "lingbot-rejoin";  // sessionStorage: {token, reconnect_s} of the world this tab plays
let awaySince = null;  // when (ms) the socket went while the world played: the page rejoins until reconnect_s

function show(state, extra = "") {
  const s = $("status");
  s.dataset.state = state;
  if (stats) {
    s.dataset.blocks = stats.blocks;
    s.dataset.frames = stats.frames;
    s.dataset.keys = stats.keys.join(",");
    s.dataset.prompt = stats.prompt;
    s.dataset.events = stats.events;
    s.dataset.skipped = stats.skipped;
    if (stats.blocks) { s.dataset.firstIndex = stats.firstIndex; s.dataset.index = stats.index; }
  }
  const parts = [`state: ${state}`];
  if (state === "starting") {
    const waited = Math.round((performance.now() - startedAt) / 1000);
    parts.push(told ? `${waited} s: ${told} (on a CPU server that takes minutes at 832x480, seconds at 128x128)` :
      "reaching the player");
  }
  if (stats && stats.blocks) {
    parts.push(`blocks ${stats.blocks}`, `frames ${stats.frames}`,
      `first block ${stats.first.toFixed(2)} s`, `step latency ${stats.latency.toFixed(2)} s`,
      `real-time factor ${stats.rtf === null ? "n/a" : stats.rtf.toFixed(2) + "x"}`, `held blocks ${stats.held}`,
      `prompt "${stats.prompt}"`);
  }
  if (stats && stats.skipped) parts.push(`skipped ${stats.skipped} frames to keep up`);
  s.textContent = parts.join(" · ") + extra;
}

function fail(message) {
  $("error").textContent = message;
  $("error").hidden = false;
}

function heldKeys() { return [...held].sort().join(""); }

// keys, events, saves and stop: on the data channel while the page plays over WebRTC, else on the websocket
function sendControl(message) {
  if (rtc && rtc.channel.readyState === "open") rtc.channel.send(JSON.stringify(message));
  else if (ws && ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify(message));
}

function sendKeys() { sendControl({type: "keys", keys: heldKeys()}); }

// Which element shows the world: the <video> (WebRTC) or the canvas (JPEG); the note says which, and why JPEG.
function showVideo(via, note) {
  const n = $("video-note");
  n.dataset.video = via;
  n.dataset.codec = rtc ? rtc.codec : "";
  n.textContent = note;
  n.hidden = false;
  $("video").hidden = via !== "webrtc";
  screen.hidden = via === "webrtc";
}

function useJpeg(why) {
  if (rtc) rtc.pc.close();
  rtc = null;
  showVideo("jpeg", `Video: JPEG over the websocket (${why}).`);
}

// Set up the video for the session on `socket`: WebRTC if the bridge offers it and it connects, else JPEG.
async function openVideo(socket, webrtc) {
  if (!webrtc) { useJpeg("this player sends no WebRTC"); return; }
  let mine;
  try {
    mine = await connectVideo(webrtc.ice_servers, "controls", (sdp) => new Promise((resolve, reject) => {
      answered = {resolve, reject};
      socket.send(JSON.stringify({type: "offer", sdp}));
    }), $("video"));
  } catch (e) {
    if (socket !== ws) return;
    if (socket.readyState === WebSocket.OPEN) socket.send(JSON.stringify({type: "jpeg"}));
    useJpeg(`WebRTC failed: ${e.message}`);
    return;
  }
  if (socket !== ws) { mine.pc.close(); return; }  // a newer session took the page meanwhile
  rtc = mine;
  mine.channel.addEventListener("message", (e) => {
    const msg = JSON.parse(e.data);
    if (msg.type === "on_air") $("status").dataset.onAir = msg.block;  // its first frame is on the video now
  });
  mine.pc.addEventListener("connectionstatechange", () => {
    if (mine !== rtc || mine.pc.connectionState !== "failed") return;
    // the bridge closes it when the world is over
    if (["ended", "failed", "closed"].includes($("status").dataset.state)) return;
    if (socket.readyState === WebSocket.OPEN) socket.send(JSON.stringify({type: "jpeg"}));
    useJpeg("WebRTC failed while playing");
  });
  showVideo("webrtc", `Video: WebRTC (${mine.codec.replace("video/", "")}).`);
}

function onKey(event, down) {
  const key = event.key.toLowerCase();
  if (!KEYS.includes(key) || event.target.tagName === "INPUT") return;
  event.preventDefault();
  const before = heldKeys();
  down ? held.add(key) : held.delete(key);
  if (heldKeys() !== before) sendKeys();
}
document.addEventListener("keydown", (e) => onKey(e, true));
document.addEventListener("keyup", (e) => onKey(e, false));
window.addEventListener("blur", () => { held.clear(); sendKeys(); });

function readImage() {
  const file = $("image").files[0];
  if ($("source").value !== "upload") return Promise.resolve(null);
  if (!file) return Promise.reject(new Error("choose a picture to upload, or use the generated test scene"));
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(new Error("the picture could not be read"));
    reader.readAsDataURL(file);
  });
}

function onMessage(event) {
  if (event.data instanceof Blob) {
    if (screen.hidden) { screen.hidden = false; $("video").hidden = true; }  // the bridge sends JPEG after all
    const slot = {bitmap: null, skipped: false};
    queue.push(slot);
    createImageBitmap(event.data).then((b) => { if (slot.skipped) b.close(); else slot.bitmap = b; });
    if (queue.length > maxQueued) skipOldest(queue.length - maxQueued);
    return;
  }
  const msg = JSON.parse(event.data);
  if (msg.type === "session") {
    sessionStorage.setItem(REJOIN, JSON.stringify({token: msg.rejoin, reconnect_s: msg.reconnect_s}));
    $("download").href = msg.video;
    $("download-recording").href = msg.recording;
    if (msg.rejoined) {  // the world plays on: the blocks made while the page was away come first
      awaySince = null;
      $("status").dataset.rejoins = Number($("status").dataset.rejoins || 0) + 1;
      show(stats.blocks ? "playing" : "starting");
    } else {
      ws.send(JSON.stringify(startMessage()));  // the world starts while its video connects (JPEG until it does)
    }
    openVideo(ws, msg.webrtc);
  } else if (msg.type === "answer") {
    if (answered) answered.resolve(msg);
    answered = null;
  } else if (msg.type === "watch") {
    showWatch(msg);
  } else if (msg.type === "starting") {  // the bridge's first word, at once: the world went to the server
    told = msg.text;
    $("status").dataset.toldMs = Math.round(performance.now() - startedAt);
    show("starting");
  } else if (msg.type === "place") {  // waiting for a slot: its place in the queue (0: it has one now)
    $("status").dataset.place = msg.position;
    show(msg.position ? "waiting" : "starting", msg.position ? ` · ${msg.text}` : "");
  } else if (msg.type === "block") {
    if (!stats.blocks) stats.firstIndex = msg.index;
    stats.index = msg.index;
    stats.blocks += 1;
    stats.frames += msg.frames;
    stats.held += msg.held ? 1 : 0;
    stats.keys.push(msg.keys || "-");
    stats.prompt = msg.prompt;
    stats.events += msg.event ? 1 : 0;
    stats.latency = msg.step_latency_s;
    stats.rtf = msg.realtime_factor;
    maxQueued = msg.frames + SLACK_FRAMES;
    if (msg.first_block_s !== null) stats.first = msg.first_block_s;
    show(stats.stopping ? "stopping" : "playing");
  } else if (msg.type === "snapshot") {  // a save's outcome: the one the page asked for is shown with its link
    if (msg.error === null) $("status").dataset.snapshotBlock = msg.block;
    if (msg.asked) showSaved(msg);
  } else if (msg.type === "failover") {
    const s = $("status").dataset;
    const where = msg.block === null ? "its next block" : `block ${msg.block}`;
    if (msg.took_s === null) {
      s.failovers = Number(s.failovers) + 1;
      $("failover").textContent = `server lost, resuming at ${where} (${msg.reason})`;
      show("resuming");
    } else {
      s.resumedS = msg.took_s.toFixed(2);
      s.differed = msg.differed;
      $("failover").textContent = `server lost, resumed at ${where} after ${msg.took_s.toFixed(2)} s ` +
        `(${msg.replayed} block(s) made again${msg.differed ? `, ${msg.differed} not bit for bit` : ""}, ` +
        `${msg.resent} step(s) sent again)`;
      show(stats.stopping ? "stopping" : "playing");
    }
    $("failover").hidden = false;
  } else if (msg.type === "ended") {
    sessionStorage.removeItem(REJOIN);
    show("ended");
    $("download").hidden = msg.frames === 0;
    $("download-recording").hidden = !msg.recorded;
    finish();
  } else if (msg.type === "error") {
    sessionStorage.removeItem(REJOIN);  // the world ended (or was not found: REJOIN_REFUSED, REJOIN_EXPIRED)
    if (answered) answered.reject(new Error(msg.message));
    answered = null;
    $("status").dataset.code = msg.code || "";
    fail(msg.message + (msg.retry_after_s ? ` (retry in ${msg.retry_after_s} s)` : ""));
    $("download-recording").hidden = !msg.recorded;
    show(stats ? "failed" : "idle");
    finish();
  }
}

// Drop the `count` oldest queued frames: the page has fallen behind the stream.
function skipOldest(count) {
  for (const slot of queue.splice(0, count)) {
    slot.skipped = true;
    if (slot.bitmap) slot.bitmap.close();
  }
  stats.skipped += count;
  show($("status").dataset.state);
}

function showSaved(msg) {
  if (msg.error !== null) { fail(`the world was not saved: ${msg.error}`); return; }
  const query = new URLSearchParams(location.search);
  query.set("resume", msg.id);
  $("saved-block").textContent = msg.block;
  $("saved-id").textContent = msg.id;
  $("resume-link").href = `${location.pathname}?${query}`;
  $("saved").hidden = false;
}

// A watch link's state: {id, path} while it works; id null after a revoke ("revoked": the watchers it ended).
function showWatch(msg) {
  const link = $("watch-link");
  link.hidden = $("revoke").hidden = msg.id === null;
  if (msg.id !== null) {
    link.href = msg.path;
    link.textContent = new URL(msg.path, location.href).href;
  }
  $("revoked").hidden = msg.id !== null;
  $("revoked").textContent = msg.id === null ? `link revoked (${msg.revoked} watcher(s) ended)` : "";
  $("watching").dataset.watchId = msg.id || "";
}

function finish() {
  $("start").disabled = false;
  $("stop").disabled = true;
  $("save").disabled = true;
  $("watch").disabled = true;
  $("watch-link").hidden = $("revoke").hidden = true;  // the world's end ends its link
}

async function start(event) {
  event.preventDefault();
  $("error").hidden = true;
  $("download").hidden = true;
  $("download-recording").hidden = true;
  let image;
  try { image = await readImage(); } catch (e) { fail(e.message); return; }
  if (ws) {  // the previous session's socket: its late events must not touch this session
    ws.onmessage = ws.onclose = null;
    ws.close();
  }
  if (rtc) rtc.pc.close();
  rtc = answered = null;
  sessionStorage.removeItem(REJOIN);
  startMessage = () => resumeId ? {type: "start", resume: resumeId, keys: heldKeys()} : {
    type: "start", prompt: $("prompt").value, image, keys: heldKeys(),
    width: Number($("width").value), height: Number($("height").value),
  };
  fresh();
  connect({});
  playing();
  screen.focus();
  startedAt = performance.now();
  show("starting");
}

// A new session's counters and state on the page.
function fresh() {
  queue = [];
  told = "";
  awaySince = null;
  delete $("status").dataset.toldMs;
  delete $("status").dataset.place;
  delete $("status").dataset.code;
  delete $("status").dataset.snapshotBlock;
  delete $("status").dataset.resumedS;
  $("status").dataset.failovers = 0;
  $("failover").hidden = true;
  $("saved").hidden = true;
  stats = {blocks: 0, frames: 0, held: 0, first: 0, latency: 0, rtf: null, keys: [], prompt: "", events: 0,
    skipped: 0, stopping: false};
}

function playing() {
  $("start").disabled = true;
  $("stop").disabled = false;
  $("save").disabled = false;
  $("watch").disabled = false;
}

// The session's websocket (the page's query: ?token=...), with `extra` parameters (a rejoin's).
function connect(extra) {
  const query = new URLSearchParams(location.search);
  for (const [name, value] of Object.entries(extra)) query.set(name, value);
  const socket = new WebSocket(`${location.protocol === "https:" ? "wss" : "ws"}://${location.host}/ws?${query}`);
  ws = socket;
  socket.binaryType = "blob";
  socket.onmessage = (e) => { if (socket === ws) onMessage(e); };
  socket.onclose = () => { if (socket === ws) closed(); };
}

// The socket closed: while the world plays and its token holds (reconnect_s since the drop), rejoin; else it ended.
function closed() {
  if (["ended", "failed"].includes($("status").dataset.state)) return;
  const held = JSON.parse(sessionStorage.getItem(REJOIN) || "null");
  if (held && (awaySince === null || performance.now() - awaySince < held.reconnect_s * 1000)) {
    if (awaySince === null) awaySince = performance.now();
    if (rtc) rtc.pc.close();
    rtc = answered = null;
    show("rejoining");
    setTimeout(() => connect({rejoin: held.token, keys: heldKeys() || "-"}), 1000);
    return;
  }
  sessionStorage.removeItem(REJOIN);
  fail("the connection to the player closed");
  show("closed");
  finish();
}

$("setup").addEventListener("submit", start);
// A prompt event: Enter sends the box's prompt; it rides on the next step (the status line shows it once in force).
$("event").addEventListener("keydown", (e) => {
  if (e.key !== "Enter") return;
  e.preventDefault();
  const prompt = $("event").value.trim();
  if (!prompt || !ws || ws.readyState !== WebSocket.OPEN) return;
  sendControl({type: "event", prompt, recache: $("recache").checked});
  $("event").value = "";
});
$("save").addEventListener("click", () => sendControl({type: "save"}));
$("watch").addEventListener("click", () => {
  if (ws && ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify({type: "watch"}));
});
$("revoke").addEventListener("click", () => {
  if (ws && ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify({type: "revoke"}));
});
if (resumeId) {  // ?resume=ID: Start plays on from that saved world (its prompt, first frame and size are its own)
  $("resuming").textContent = `Start resumes the saved world ${resumeId}.`;
  $("resuming").hidden = false;
  $("start").textContent = "Resume world";
}
$("stop").addEventListener("click", () => {
  sendControl({type: "stop"});
  stats.stopping = true;
  $("stop").disabled = true;
  show("stopping");
});
setInterval(() => { if ($("status").dataset.state === "starting") show("starting"); }, 1000);
// The WebRTC video's counters on the status line while it plays: frames decoded, bytes received (the transport's).
setInterval(async () => {
  if (!rtc || !stats || !stats.blocks) return;
  const v = await videoStats(rtc.pc);
  Object.assign($("status").dataset, {decoded: v.decoded, videoBytes: v.transportBytes});
}, 1000);
$("source").addEventListener("change", () => { $("image").hidden = $("source").value !== "upload"; });
screen.tabIndex = 0;

// Play decoded frames at 16 fps, in order; a frame still decoding holds the queue.
setInterval(() => {
  if (queue.length && queue[0].bitmap) {
    const {bitmap} = queue.shift();
    if (screen.width !== bitmap.width || screen.height !== bitmap.height) {
      screen.width = bitmap.width;
      screen.height = bitmap.height;
    }
    ctx.drawImage(bitmap, 0, 0);
    bitmap.close();
  }
}, 1000 / FPS);

// A reload while the world played: back to it at once.
function rejoinHeldWorld() {
  const heldWorld = JSON.parse(sessionStorage.getItem(REJOIN) || "null");
  if (heldWorld) {
    fresh();
    playing();
    startedAt = awaySince = performance.now();
    show("rejoining");
    connect({rejoin: heldWorld.token, keys: "-"});
  }
}

// Sign-in (a bridge started with --sign-in): the key goes to the bridge once, which keeps it and gives this page a
// short-lived HttpOnly cookie instead; the page never stores the key.
async function showSignIn() {
  const who = await (await fetch("/whoami")).json();
  $("signin").hidden = !who.sign_in || who.signed_in;
  $("setup").hidden = who.sign_in && !who.signed_in;
}
$("signin").addEventListener("submit", async (event) => {
  event.preventDefault();
  $("error").hidden = true;
  const answer = await fetch("/signin", {method: "POST", headers: {"Content-Type": "application/json"},
                                         body: JSON.stringify({key: $("key").value})});
  $("key").value = "";
  if (!answer.ok) fail(await answer.text());
  await showSignIn();
  rejoinHeldWorld();
});
showSignIn();
rejoinHeldWorld();
