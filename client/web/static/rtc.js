// WebRTC for the player's page and the watch page: a peer connection that receives the world's video and opens a
// data channel. The page offers once its candidates are gathered (the bridge takes no trickled candidates), the
// bridge answers; the video then plays in a <video> element.
"use strict";
const GATHER_MS = 3000;    // the longest an offer waits for its candidates
const CONNECT_MS = 10000;  // the longest a connection may take before the page gives up on WebRTC

function within(ms, what, promise) {
  let timer;
  return Promise.race([promise, new Promise((_, reject) => {
    timer = setTimeout(() => reject(new Error(`no ${what} within ${ms / 1000} s`)), ms);
  })]).finally(() => clearTimeout(timer));
}

function gathered(pc) {
  return new Promise((resolve) => {
    if (pc.iceGatheringState === "complete") resolve();
    pc.addEventListener("icegatheringstatechange", () => { if (pc.iceGatheringState === "complete") resolve(); });
    setTimeout(resolve, GATHER_MS);  // offer the candidates gathered so far
  });
}

function connected(pc) {
  return new Promise((resolve, reject) => {
    const check = () => {
      if (pc.connectionState === "connected") resolve();
      if (["failed", "closed"].includes(pc.connectionState)) reject(new Error(`the connection ${pc.connectionState}`));
    };
    pc.addEventListener("connectionstatechange", check);
    check();
  });
}

// A connection playing into `video`: `exchange(sdp)` sends the offer and resolves with the answer ({sdp, codec}).
// Resolves with {pc, channel, codec} once connected with the channel open; rejects (the connection closed) if not.
async function connectVideo(iceServers, label, exchange, video) {
  if (!window.RTCPeerConnection) throw new Error("this browser has no WebRTC");
  const pc = new RTCPeerConnection({iceServers});
  try {
    pc.addTransceiver("video", {direction: "recvonly"});
    const channel = pc.createDataChannel(label);
    const opened = new Promise((resolve) => channel.addEventListener("open", resolve));
    pc.addEventListener("track", (e) => { video.srcObject = new MediaStream([e.track]); });
    await pc.setLocalDescription(await pc.createOffer());
    await gathered(pc);
    const answer = await within(CONNECT_MS, "answer", exchange(pc.localDescription.sdp));
    await pc.setRemoteDescription({type: "answer", sdp: answer.sdp});
    await within(CONNECT_MS, "connection", Promise.all([connected(pc), opened]));
    return {pc, channel, codec: answer.codec || ""};
  } catch (e) {
    pc.close();
    throw e;
  }
}

// The received video's counters: frames decoded, bytes (RTP payload and all the transport's), codec.
async function videoStats(pc) {
  const out = {decoded: 0, bytes: 0, transportBytes: 0, codec: ""};
  const stats = await pc.getStats();
  stats.forEach((s) => {
    if (s.type === "inbound-rtp" && s.kind === "video") {
      out.decoded = s.framesDecoded || 0;
      out.bytes = s.bytesReceived || 0;
      const codec = stats.get(s.codecId);
      if (codec) out.codec = codec.mimeType;
    } else if (s.type === "transport") {
      out.transportBytes = s.bytesReceived || 0;
    }
  });
  return out;
}
