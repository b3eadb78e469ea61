// The watch page (/watch/ID): the world's video over WebRTC, read-only. Its data channel carries only the bridge's
// word on why the stream ended ({type: "error", code, message}: the link revoked, the world ended); this page sends
// nothing on it. A refused offer shows the bridge's code and sentence.
"use strict";
const $ = (id) => document.getElementById(id);
const link = location.pathname.split("/").filter(Boolean).pop();
let pc = null;
let channel = null;  // its data channel: the bridge's word to this page

function show(state, extra = "") {
  $("status").dataset.state = state;
  $("status").textContent = `state: ${state}` + extra;
}

function end(code, message) {
  $("status").dataset.code = code || "";
  $("error").textContent = message + (code ? ` (${code})` : "");
  $("error").hidden = false;
  show(code === "WORLD_ENDED" ? "ended" : "refused");
}

async function exchange(sdp) {
  const answer = await fetch(`/watch/${link}/offer`, {method: "POST", headers: {"Content-Type": "application/sdp"},
                                                     body: sdp});
  const body = await answer.json();
  if (!answer.ok) {
    const error = new Error(body.message);
    error.code = body.code;
    throw error;
  }
  return body;
}

async function watch() {
  try {
    const ice = await fetch(`/watch/${link}/ice`);
    const config = await ice.json();
    if (!ice.ok) { end(config.code, config.message); return; }
    const made = await connectVideo(config.ice_servers, "watch", exchange, $("video"));
    pc = made.pc;
    channel = made.channel;
    $("status").dataset.codec = made.codec;
    made.channel.addEventListener("message", (e) => { const msg = JSON.parse(e.data); end(msg.code, msg.message); });
    made.channel.addEventListener("close", () => { if ($("status").dataset.state === "watching") show("ended"); });
    show("watching");
  } catch (e) {
    end(e.code, e.code ? e.message : `WebRTC failed: ${e.message}`);
  }
}

setInterval(async () => {
  if (!pc) return;
  const v = await videoStats(pc);
  $("status").dataset.decoded = v.decoded;
  if ($("status").dataset.state === "watching") show("watching", ` · ${v.decoded} frames · ${v.codec}`);
}, 500);
watch();
