//! The load generator's verdicts: a request succeeds only when its answer came whole, and
//! each other ending is named. Each case is an answer written byte for byte by a socket of the
//! test, as a server or a proxy cut short would write it.

use specd_e2e::traffic::{Api, Failure, Load, Traffic};
use std::io::{Read, Write};
use std::net::TcpListener;
use std::time::Duration;

const OAI_LAST: &str = r#"{"choices":[{"index":0,"text":".","finish_reason":"length"}]}"#;
const OAI_MID: &str = r#"{"choices":[{"index":0,"text":" the","finish_reason":null}]}"#;

fn chunk(s: &str) -> String {
    format!("{:x}\r\n{s}\r\n", s.len())
}

fn sse_head() -> String {
    "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n".into()
}

/// One request of `api` answered with `answer` (then the connection is closed, or left open
/// with `hold`); how the load generator judged it.
fn verdict(api: Api, answer: &str, hold: bool) -> Result<(), Failure> {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let answer = answer.to_string();
    let server = std::thread::spawn(move || {
        let (mut c, _) = l.accept().unwrap();
        let mut buf = [0u8; 4096];
        let _ = c.read(&mut buf);
        c.write_all(answer.as_bytes()).unwrap();
        if hold {
            // Keep the connection open until the client gives up.
            let _ = c.read(&mut buf);
        }
    });
    let t = Traffic::start(Load { clients: 1, timeout: Duration::from_millis(500), ..Load::new(port, api) });
    specd_e2e::wait_until("the request to end", Duration::from_secs(10), || {
        let (_, ok, failed) = t.counts();
        ok + failed >= 1
    })
    .unwrap();
    let s = t.stop();
    server.join().unwrap();
    s.records[0].result.clone()
}

#[test]
fn a_whole_stream_succeeds() {
    let body = format!(
        "{}{}{}0\r\n\r\n",
        chunk(&format!("data: {OAI_MID}\n\n")),
        chunk(&format!("data: {OAI_LAST}\n\n")),
        chunk("data: [DONE]\n\n")
    );
    assert_eq!(verdict(Api::OpenAiCompletions, &(sse_head() + &body), false), Ok(()));
    // llama.cpp's /completion sends no [DONE]: its last chunk says stop.
    let body = format!(
        "{}{}0\r\n\r\n",
        chunk("data: {\"content\":\" a\",\"stop\":false}\n\n"),
        chunk("data: {\"content\":\"\",\"stop\":true}\n\n")
    );
    assert_eq!(verdict(Api::LlamaCompletion, &(sse_head() + &body), false), Ok(()));
    // A body delimited by the connection's end (HTTP/1.0).
    let body = format!("data: {OAI_LAST}\n\ndata: [DONE]\n\n");
    assert_eq!(verdict(Api::OpenAiCompletions, &format!("HTTP/1.0 200 OK\r\n\r\n{body}"), false), Ok(()));
}

#[test]
fn a_stream_without_its_end_is_cut() {
    // The final chunk, but no [DONE] and no last chunk of the body: the connection closed.
    let body = chunk(&format!("data: {OAI_LAST}\n\n"));
    assert!(matches!(verdict(Api::OpenAiCompletions, &(sse_head() + &body), false), Err(Failure::Cut(_))));
    // Tokens, then the body ends properly but without the final chunk.
    let body = format!("{}0\r\n\r\n", chunk(&format!("data: {OAI_MID}\n\n")));
    let v = verdict(Api::OpenAiCompletions, &(sse_head() + &body), false);
    assert_eq!(v, Err(Failure::Cut(OAI_MID.into())));
}

#[test]
fn an_error_in_the_stream_is_an_error_chunk() {
    let err = r#"{"error": {"message": "EngineCore encountered an issue.", "type": "InternalServerError", "param": null, "code": 500}}"#;
    let body = format!(
        "{}{}{}0\r\n\r\n",
        chunk(&format!("data: {OAI_MID}\n\n")),
        chunk(&format!("data: {err}\n\n")),
        chunk("data: [DONE]\n\n")
    );
    assert_eq!(verdict(Api::OpenAiCompletions, &(sse_head() + &body), false), Err(Failure::ErrorChunk(err.into())));
}

#[test]
fn statuses_silences_and_closed_connections_are_named() {
    let v = verdict(Api::SglangGenerate, "HTTP/1.1 503 Service Unavailable\r\nContent-Length: 5\r\n\r\nbusy!", false);
    assert_eq!(v, Err(Failure::Status(503, "busy!".into())));
    assert_eq!(verdict(Api::SglangGenerate, "", false), Err(Failure::NoReply));
    // Tokens, then nothing more while the connection stays open.
    let body = chunk("data: {\"text\":\"a\",\"meta_info\":{\"finish_reason\":null}}\n\n");
    assert_eq!(verdict(Api::SglangGenerate, &(sse_head() + &body), true), Err(Failure::Timeout));
    // Nobody listening.
    let port = specd_e2e::free_port();
    let t = Traffic::start(Load { clients: 1, ..Load::new(port, Api::SglangGenerate) });
    specd_e2e::wait_until("a refusal", Duration::from_secs(5), || t.counts().2 >= 1).unwrap();
    let s = t.stop();
    assert_eq!(s.records[0].result, Err(Failure::Refused));
    assert_eq!(s.succeeded, 0);
    assert_eq!(s.failed.get("refused"), Some(&s.sent), "{s}");
}
